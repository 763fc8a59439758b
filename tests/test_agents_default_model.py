"""On the real default model (SmolLM2, no native tool syntax): constrained calls always parse and
validate across seeds with tool_choice="required", and later seeds reuse the shared prompt."""

from . import agents_support  # noqa: F401
from justfit_agents import Agent
from justfit_agents.grammar import validate


def convert(amount: float, unit: str) -> str:
    """Convert an amount to metres.

    Args:
        amount: the number to convert
        unit: the unit it is in, e.g. "ft"
    """
    return f"{amount} {unit}"


def test_required_calls_parse_and_validate_on_default_model(runtime16):
    seen = set()
    for seed in range(5):
        a = Agent(runtime16, tools=[convert], tool_choice="required", max_steps=1, temperature=1.0,
                  seed=seed, max_string=12, max_tokens=64)
        r = a.run("How many metres are 12 feet?")
        step = r.steps[0]
        assert step.call is not None and step.stats["finish_reason"] == "grammar", step.text
        schema = {**a.tools[step.call.name].parameters, "additionalProperties": False}
        assert validate(step.call.arguments, schema) == [], step.text
        seen.add(step.text)
        if seed:
            assert step.stats["prefilled_tokens"] <= 1  # same system prompt + task: from the prefix pool
    assert len(seen) > 1  # sampling really varied, so the grammar held on different paths
