"""Agent.fan_out runs sub-agents as one batch on the runtime's batching engine: greedy results equal
spawning them one after another, their turns share engine steps, and every page comes back."""

import pytest

from tests.agents_support import TinyRuntime
from justfit_agents import Agent


def lookup(key: str) -> str:
    """Look a key up in the table.

    Args:
        key: which entry
    """
    return f"value of {key}"


@pytest.fixture(scope="module")
def tiny(default_model_dir, tmp_path_factory):
    return TinyRuntime(default_model_dir, tmp_path_factory.mktemp("fanout-home"))


def _summary(results):
    return [(r.answer, r.stopped, [(s.text, s.call and (s.call.name, s.call.arguments)) for s in r.steps])
            for r in results]


def test_fan_out_batches_sub_agents_and_matches_sequential_greedy(tiny):
    before = tiny.index.sequence_refs()
    parent = Agent(tiny, tools=[lookup], tool_choice="required", max_steps=1, max_string=12, max_tokens=40)
    parent.run("Find key 1.")
    tasks = ["Find key 2.", "Find key 3 and then key 4.", "Find key 5."]
    opts = dict(max_steps=2, tool_choice="required", max_tokens=40)
    one_by_one = [parent.spawn(t, record=False, **opts) for t in tasks]  # the reference: sequential
    n = len(parent.messages)
    steps0 = tiny.batch_engine().steps
    together = parent.fan_out(tasks, **opts)
    assert _summary(together) == _summary(one_by_one)
    generated = sum(s.stats.generated_tokens for r in together for s in r.steps)
    assert generated > 20
    assert tiny.batch_engine().steps - steps0 < generated  # turns shared engine steps (one by one: >= one each)
    reused = [r.steps[0].stats.reused_tokens for r in together]
    assert min(reused) >= parent.state.cached - 1  # the fork point came from the prefix index
    assert len(parent.messages) == n + 6
    assert all(r.answer in parent.messages[n + 2 * i + 1]["content"] for i, r in enumerate(together))
    parent.close()
    assert tiny.index.sequence_refs() == before  # every sub-agent gave its pages back


def test_fan_out_free_text_equals_sequential_on_the_default_model(runtime16):
    parent = Agent(runtime16, system="You answer in one short sentence.", tool_choice="none", max_steps=1,
                   max_tokens=16)
    parent.run("What is the capital of France?")
    tasks = ["Name a color.", "Name an animal that lives in the sea.", "Name a fruit."]
    one_by_one = [parent.spawn(t, record=False, max_steps=1) for t in tasks]
    together = parent.fan_out(tasks, max_steps=1)
    assert _summary(together) == _summary(one_by_one)
    assert len({r.answer for r in together}) > 1  # different tasks, different replies: rows were not mixed up
    parent.close()


def test_fan_out_with_sampling_runs_and_releases(tiny):
    before = tiny.index.sequence_refs()
    parent = Agent(tiny, tools=[lookup], tool_choice={"name": "lookup"}, max_steps=1, temperature=1.0, seed=4,
                   max_string=8)
    parent.run("Find key 9.")
    results = parent.fan_out(["a", "b"], max_steps=2)
    assert [len(r.steps) for r in results] == [2, 2] or all(r.steps for r in results)
    assert all(s.call is not None for r in results for s in r.steps)  # the grammar held inside the batch
    parent.close()
    assert tiny.index.sequence_refs() == before


def test_an_error_in_one_sub_agent_cancels_the_others(tiny):
    before = tiny.index.sequence_refs()
    parent = Agent(tiny, tools=[lookup], tool_choice={"name": "lookup"}, max_steps=1, max_string=8)
    parent.run("Find key 9.")
    calls = []

    def stop(step):
        calls.append(step)
        if len(calls) == 2:
            raise RuntimeError("boom")  # a second sub-agent fails while the first has a turn queued
        return False

    with pytest.raises(RuntimeError, match="boom"):
        parent.fan_out(["a", "b", "c"], max_steps=3, tool_choice={"name": "lookup"}, stop=stop, max_tokens=200)
    assert tiny.batch_engine().idle()  # the other sub-agents' turns were cancelled, not left queued
    parent.close()
    assert tiny.index.sequence_refs() == before
