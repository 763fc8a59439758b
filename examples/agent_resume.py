"""Resume after a restart: run this twice. The second run finds the named session on disk, so the
system prompt, tools and first task are not prefilled again (see 'reused' below)."""
import sys

import justfit
from justfit_agents import Agent


def remember(fact: str) -> str:
    """Store a fact for later.

    Args:
        fact: the fact to store
    """
    return f"stored: {fact}"


# One forced call a run (what a 135M model does reliably); the session keeps every run's turns.
agent = Agent(justfit.Runtime(), tools=[remember], tool_choice={"name": "remember"}, max_steps=1,
              max_string=27, session="resume-demo")  # max_string: a fact, not a story
earlier = [m for m in agent.messages if m["role"] != "system"]
print(f"resumed session 'resume-demo': {len(earlier)} earlier message{'s' * (len(earlier) != 1)}" if earlier
      else "new session 'resume-demo' (run again to resume it)")
task = sys.argv[1] if len(sys.argv) > 1 else "Remember that the meeting is at 10."
result = agent.run(task)
step = result.steps[0]
print(f"prompt {step.stats.prompt_tokens} tokens: reused {step.stats.reused_tokens}, "
      f"prefilled {step.stats.prefilled_tokens}")
print(f"called {step.call.name}({step.call.arguments}) -> {step.call.result}")
