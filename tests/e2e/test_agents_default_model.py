"""On the real default model (SmolLM2, no native tool syntax): constrained calls always parse and
validate across seeds with tool_choice="required", and later seeds reuse the shared prompt."""

from tests import agents_support  # noqa: F401
from justfit_agents import Agent
from justfit.grammar import validate


def convert(amount: float, unit: str) -> str:
    """Convert an amount to metres.

    Args:
        amount: the number to convert
        unit: the unit it is in, e.g. "ft"
    """
    return f"{amount} {unit}"


def test_required_calls_parse_and_validate_on_default_model(runtime16):
    seen = set()
    for seed in range(3):
        a = Agent(runtime16, tools=[convert], tool_choice="required", max_steps=1, temperature=1.0,
                  seed=seed, max_string=12, max_tokens=64)
        r = a.run("How many metres are 12 feet?")
        step = r.steps[0]
        assert step.call is not None and step.stats.finish_reason == "stop", step.text
        schema = {**a.tools[step.call.name].parameters, "additionalProperties": False}
        assert validate(step.call.arguments, schema) == [], step.text
        seen.add(step.text)
        if seed:
            assert step.stats.prefilled_tokens <= 1  # same system prompt + task: from the prefix pool
    assert len(seen) > 1  # sampling really varied, so the grammar held on different paths


SESSION_RUN = """
import json, sys
sys.path.insert(0, {agents!r})
import justfit
from justfit_agents import Agent
rt = justfit.Runtime(model={model!r}, kv=justfit.KVConfig(bits=16), home={home!r})
system = "You are a careful assistant. Answer in one short sentence. " * 30  # > one 256-token page
a = Agent(rt, system=system, session="resume", tool_choice={{"name": "final_answer"}}, max_steps=1, max_string=8, max_tokens=32)
restored = len(a.messages)
r = a.run(sys.argv[1])
print(json.dumps({{"persisted": a.state.session.persist, "restored": restored, "stats": r.steps[0].stats.as_dict()}}))
"""


def test_statetrans_session_resumes_after_restart(default_model_dir, tmp_path):
    import json
    import subprocess
    import sys

    from tests.agents_support import AGENTS

    script = tmp_path / "run.py"
    script.write_text(SESSION_RUN.format(agents=str(AGENTS), model=str(default_model_dir), home=str(tmp_path)))
    run = lambda task: json.loads(subprocess.run([sys.executable, str(script), task], capture_output=True,  # noqa: E731
                                                 text=True, check=True).stdout.strip().splitlines()[-1])
    first = run("Say hi.")
    assert first["persisted"] and first["restored"] == 1 and first["stats"]["reused_tokens"] == 0
    second = run("Say bye.")
    assert second["restored"] == 4  # system, task, call, result came back from the session manifest
    # its sealed pages came back too: at least one full 256-token page is not prefilled again
    assert second["stats"]["reused_tokens"] >= 256
    assert second["stats"]["prefilled_tokens"] == second["stats"]["prompt_tokens"] - second["stats"]["reused_tokens"]
