"""The agent loop on a tiny random-weight model with the real tokenizer: every constrained call
parses and validates, each step prefills only its new tokens, forks and sub-agents reuse the
parent's prefix, tools run in tool phases, and a named agent resumes after a restart."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.agents_support import AGENTS, TinyRuntime
from justfit_agents import Agent
from justfit.grammar import validate


def lookup(key: str, count: int = 1) -> str:
    """Look a key up in the table.

    Args:
        key: which entry
        count: how many rows
    """
    return f"value of {key} x{count}"


@pytest.fixture(scope="module")
def tiny(default_model_dir, tmp_path_factory):
    return TinyRuntime(default_model_dir, tmp_path_factory.mktemp("home"))


def test_constrained_calls_always_parse_and_validate(tiny):
    # A random model proposes garbage; the grammar must still make every call well formed.
    for seed in range(12):
        a = Agent(tiny, tools=[lookup], tool_choice="required", max_steps=2, temperature=1.5, seed=seed,
                  max_string=24, max_tokens=200)
        r = a.run("Find key 7.")
        assert r.steps and r.stopped != "length"
        for s in r.steps:
            assert s.call is not None, s.text
            tool = a.tools[s.call.name]
            assert validate(s.call.arguments, {**tool.parameters, "additionalProperties": False}) == []
            assert json.loads(s.text.split("<tool_call>\n")[1].split("\n</tool_call>")[0])["name"] == s.call.name


def test_named_choice_forces_that_tool_first(tiny):
    a = Agent(tiny, tools=[lookup], tool_choice={"name": "lookup"}, max_steps=1, temperature=1.0, seed=3)
    r = a.run("hello")
    assert r.steps[0].call.name == "lookup"


def test_each_step_prefills_only_new_tokens(tiny):
    before = tiny.phases
    a = Agent(tiny, system="Reuse test system prompt.", tools=[lookup], tool_choice="required",
              max_steps=3, temperature=1.0, seed=11, max_string=16)
    del a.tools["final_answer"]  # a random model may finish at once; this test needs several steps
    a.stop_on_repeat = False
    r = a.run("Find key 3.")
    assert len(r.steps) == 3
    s0, s1 = r.steps[0].stats, r.steps[1].stats
    # a new system prompt: only the template's opening tokens can come from earlier agents
    assert s0.reused_tokens < 10 and s0.prefilled_tokens == s0.prompt_tokens - s0.reused_tokens
    # step 1 reuses everything step 0 had in its cache: its prompt and every generated token
    assert s1.reused_tokens >= s0.prompt_tokens + s0.generated_tokens
    assert s1.prefilled_tokens == s1.prompt_tokens - s1.reused_tokens
    new = len(tiny.tokenizer.encode(a.messages[3]["content"], add_special_tokens=False))
    assert s1.prefilled_tokens <= new + 12  # result message + turn markers
    calls = [s for s in r.steps if s.call and s.call.name == "lookup"]
    assert len(calls) == 3 and tiny.phases - before == 3  # each (non-final) tool ran in a tool phase


def test_repeated_call_stops_with_its_result(tiny):
    a = Agent(tiny, tools=[lookup], tool_choice={"name": "lookup"}, max_steps=4, max_string=1, temperature=0.0)
    del a.tools["final_answer"]
    r = a.run("Find key 1.")  # greedy, one-char keys: the same call comes back
    assert r.stopped == "repeat" and len(r.steps) == 2 and r.answer == r.steps[-1].call.result


def test_agents_sharing_a_system_prompt_reuse_it(tiny):
    system = "Shared system prompt for two agents. " * 8
    Agent(tiny, system=system, tools=[lookup], tool_choice="required", max_steps=1).run("First task.")
    r = Agent(tiny, system=system, tools=[lookup], tool_choice="required", max_steps=1).run("Another task entirely.")
    st = r.steps[0].stats
    assert st.reused_tokens > 100 and st.prefilled_tokens < 20, st


def test_spawn_returns_result_to_parent_and_fan_out_shares_fork_point(tiny):
    parent = Agent(tiny, tools=[lookup], tool_choice="required", max_steps=2, temperature=1.0, seed=5, max_string=16)
    parent.run("Find key 1.")
    cached = parent.state.cached
    child = parent.spawn("Find key 2 in detail.", max_steps=1, tool_choice={"name": "final_answer"})
    assert child.steps[0].stats.reused_tokens >= cached
    assert parent.messages[-2]["content"].startswith("<tool_call>\n{\"name\": \"spawn_agent\"")
    assert child.answer and child.answer in parent.messages[-1]["content"]
    assert parent.messages[-1]["content"].startswith('<tool_response name="spawn_agent">')
    n = len(parent.messages)
    results = parent.fan_out(["task A", "task B", "task C"], max_steps=1, tool_choice={"name": "final_answer"})
    reused = [r.steps[0].stats.reused_tokens for r in results]
    assert reused[0] == reused[1] == reused[2] == parent.state.cached  # same fork point, none recomputed
    assert [r.steps[0].stats.prefilled_tokens < 30 for r in results] == [True] * 3
    assert len(parent.messages) == n + 6
    assert all(r.answer in parent.messages[n + 2 * i + 1]["content"] for i, r in enumerate(results))


RESUME = textwrap.dedent("""
    import json, sys
    sys.path[:0] = [{agents!r}, {tests!r}]
    from agents_support import TinyRuntime
    from justfit_agents import Agent
    def lookup(key: str) -> str:
        '''Look a key up.'''
        return "value " + key
    rt = TinyRuntime({model!r}, {home!r})
    a = Agent(rt, tools=[lookup], tool_choice="required", session="resume-test", max_steps=2,
              temperature=1.0, seed=int(sys.argv[1]), max_string=16)
    n_msgs = len(a.messages)
    r = a.run(sys.argv[2])
    print(json.dumps({{"n_msgs": n_msgs, "first": r.steps[0].stats.as_dict(), "cached": a.state.cached}}))
""")


def test_resume_after_restart_in_a_subprocess(default_model_dir, tmp_path):
    script = tmp_path / "resume.py"
    tests_dir = str(Path(__file__).parents[1])
    script.write_text(RESUME.format(agents=str(AGENTS), tests=tests_dir, model=str(default_model_dir), home=str(tmp_path)))
    run = lambda *a: json.loads(subprocess.run([sys.executable, str(script), *a], capture_output=True, text=True,  # noqa: E731
                                               check=True).stdout.strip().splitlines()[-1])
    first = run("1", "Find key 1.")
    assert first["n_msgs"] == 1 and first["first"]["reused_tokens"] == 0
    second = run("2", "Now find key 2.")
    assert second["n_msgs"] > 1  # the conversation came back
    assert second["first"]["reused_tokens"] == first["cached"]  # and its KV cache: nothing recomputed
    assert second["first"]["prefilled_tokens"] < first["first"]["prompt_tokens"] // 3  # last result + new task
    for page in (tmp_path / "store").rglob("*.safetensors"):  # tear every stored page
        page.write_bytes(b"torn")
    third = run("3", "And key 3.")
    assert third["n_msgs"] > second["n_msgs"] and third["first"]["reused_tokens"] == 0  # recomputed, not lost
