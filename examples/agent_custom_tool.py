"""A Python function as a tool (its schema comes from the type hints and docstring), called once by the
default model under a grammar, so the call always parses (`pip install -e .` first).
Expected output: examples/expected/agent_custom_tool.txt (a test)."""
import sys

import justfit
from justfit_agents import Agent


def word_count(text: str) -> int:
    """Count the words in a text.

    Args:
        text: the text to count
    """
    return len(text.split())


# What a 135M model does well: one call with the arguments spelled out in the task. It does not reliably
# decide when it is done (it tends to call the tool again), so this run is one forced call and the
# tool's result is the answer.
agent = Agent(justfit.Runtime(), tools=[word_count], tool_choice={"name": "word_count"}, max_steps=1)
task = "How many words are in 'the quick brown fox jumps'?"
call = agent.run(task).tool_calls[0]
print(f"called {call.name}({call.arguments}) -> {call.result}")
if call.result != "5":
    sys.exit(f"wrong count {call.result!r}: the model did not pass the quoted text")
print(f"answer: {call.result} words")
