"""Resume after a restart: run this twice. The second run finds the named session on disk, so the
system prompt, tools and first task are not prefilled again (see 'reused' in step 0)."""
import sys

import justfit
from justfit_agents import Agent


def remember(fact: str) -> str:
    """Store a fact for later.

    Args:
        fact: the fact to store
    """
    return f"stored: {fact}"


agent = Agent(justfit.Runtime(), tools=[remember], tool_choice="required", max_steps=2, session="resume-demo")
print(f"{len(agent.messages)} messages restored from the session")
task = sys.argv[1] if len(sys.argv) > 1 else "Remember that the meeting is at 10."
result = agent.run(task)
print(result.transcript())
