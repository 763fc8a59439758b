"""A custom tool in a minimal agent loop on the default model (`pip install -e .` first).
Expected output: examples/expected/agent_custom_tool.txt (a test)."""
import justfit
from justfit_agents import Agent


def word_count(text: str) -> int:
    """Count the words in a text.

    Args:
        text: the text to count
    """
    return len(text.split())


agent = Agent(justfit.Runtime(), tools=[word_count], tool_choice="required", max_steps=3)
result = agent.run("How many words are in 'the quick brown fox jumps'?")
for call in result.tool_calls:
    print(f"called {call.name}({call.arguments}) -> {call.result}")
print(f"stopped: {result.stopped}")
print(f"answer: {result.answer}")
