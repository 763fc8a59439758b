"""The one generation path on the real default model: tool phases before a session prefill, token-exact
reuse through the plain API and across a restart, no page leaks from sub-agents, one renderer."""

import json
import subprocess
import sys

from tests import agents_support  # noqa: F401  (puts agents/ on the path)
from justfit_agents import Agent

LONG = ("Notes from the harbour office. The ferry leaves at nine, the cargo boat at eleven, and the "
        "fishing fleet returns before dusk. ") * 12


def test_session_prefill_after_a_tool_phase_has_its_weights_and_same_tokens(runtime16, tmp_path):
    import uuid

    rt = runtime16
    prompt = f"Log {uuid.uuid4().hex}. {LONG} When does the ferry leave?"  # never cached, not even on disk
    first = rt.session(None)
    ref = first.generate(prompt, max_tokens=8)
    first.close()  # its pages are then held by the index alone, and the eviction below drops them
    seen = []

    def progress(done, total):  # called after each prefill chunk: the weights must be in use now
        comps = [c for c in rt.phaseswap.components.values() if c.kind != "kv"]
        seen.append((rt.phaseswap.phase, all(c.resident for c in comps if "layers" in c.roles)))

    s = rt.session(None)
    with rt.tool_phase():
        assert not any(c.resident for c in rt.phaseswap.components.values() if "layers" in c.roles)
    rt.index.evict_memory(cap=0)  # nothing cached: the whole prompt is prefilled again
    g = s.generate(prompt, max_tokens=8, progress=progress)
    assert g.tokens == ref.tokens and g.stats.reused_tokens < 20  # at most the template opening (other tests)
    assert seen and all(phase == "prefill" and resident for phase, resident in seen)


def test_plain_api_chat_turn_two_reuses_all_of_turn_one(runtime16):
    rt = runtime16
    msgs = [{"role": "user", "content": "Name a colour of the sky on a clear day."}]
    g1 = rt.generate(msgs, max_tokens=12)
    turn1 = g1.stats.prompt_tokens + g1.stats.generated_tokens
    assert 30 <= turn1 <= 60  # a short chat turn: below one 256-token page
    msgs += [{"role": "assistant", "content": g1.text}, {"role": "user", "content": "And at sunset?"}]
    g2 = rt.generate(msgs, max_tokens=4)
    assert g2.stats.reused_tokens >= turn1  # prompt and reply of turn 1: nothing prefilled again


RESTART = """
import json, sys
import justfit
rt = justfit.Runtime(model=sys.argv[1], kv=justfit.KVConfig(bits=4), home=sys.argv[2])
s = rt.session("restart")
before = len(s.tokens)
g = s.generate(sys.argv[3], max_tokens=6)
print(json.dumps({"before": before, "stats": g.stats.as_dict(), "kv": s.kv_tokens}))
"""


def test_session_after_restart_prefills_only_the_new_turn(default_model_dir, tmp_path):
    run = lambda text: json.loads(subprocess.run(  # noqa: E731
        [sys.executable, "-c", RESTART, str(default_model_dir), str(tmp_path), text],
        capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
    first = run("Tell me one fact about whales.")
    second = run("And one about dolphins?")
    st = second["stats"]
    assert second["before"] > 40 and st["reused_tokens"] >= second["before"] - 2  # all old K/V came back
    # what is prefilled is the new message and the template tokens around it, nothing of the history
    assert st["prompt_tokens"] - st["reused_tokens"] <= 20
    assert first["stats"]["reused_tokens"] < first["stats"]["prompt_tokens"]


def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: which entry
    """
    return f"value of {key}"


def test_sub_agents_give_every_page_back(runtime16):
    rt = runtime16
    before = rt.index.sequence_refs()
    parent = Agent(rt, tools=[lookup], tool_choice="required", max_steps=1, max_string=8, max_tokens=24)
    parent.run("Find key 1.")
    parent.fan_out(["task A", "task B", "task C"], max_steps=1, tool_choice={"name": "final_answer"},
                   max_tokens=24)
    parent.close()
    assert rt.index.sequence_refs() == before


def test_same_messages_give_the_same_ids_in_chat_session_and_agent(runtime16):
    rt = runtime16
    system = "You answer in one word."
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Capital of France?"}]
    chat_ids = rt.encode(msgs)
    s = rt.session(None)
    s.generate(msgs, max_tokens=2)
    a = Agent(rt, system=system, tool_choice="none", max_steps=1, max_tokens=2)
    r = a.run("Capital of France?")
    n = r.steps[0].stats.prompt_tokens
    assert s.tokens[:len(chat_ids)] == chat_ids
    assert n == len(chat_ids) and a.state.session.tokens[:n] == chat_ids
    s.close()
    a.close()


def test_tool_phase_releases_a_sessions_pages_and_they_come_back(runtime16):
    import uuid

    rt = runtime16
    name = f"tool-{uuid.uuid4().hex[:8]}"
    s = rt.session(name)
    s.generate(LONG, max_tokens=4)
    ref = s.fork(None)  # same history, pages shared; its continuation is the reference
    expect = ref.generate("When does the cargo boat leave?", max_tokens=6).tokens
    ref.close()
    held = s.resident_bytes()
    assert held > 0
    with s.tool_phase() as released:
        assert s.resident_bytes() < 0.05 * held  # the session's K/V is on disk only
        assert released >= 0.9 * held
    g = s.generate("When does the cargo boat leave?", max_tokens=6)
    assert g.tokens == expect and g.stats.reused_tokens > 0.9 * len(rt.encode(LONG))
    s.close()
    from justfit.statetrans.manifest import remove_manifest

    remove_manifest(rt.home, name)


def test_a_prompts_last_pass_sends_only_its_last_row_through_the_lm_head(shallow, monkeypatch):
    """last_logits over a prompt chunk: the same logits as the whole model's last row, with one row through
    the head (the tied embedding, the largest weight) instead of every row of the chunk."""
    import mlx.core as mx

    from justfit.engine import runner
    from justfit.kvexec import make_cache

    model, ids = shallow.model, shallow.encode("Count the boats in the harbour, then the ferries.")
    want = model(mx.array(ids)[None], cache=make_cache(model, shallow.kv))[:, -1, :]
    rows, head = [], runner.head
    monkeypatch.setattr(runner, "head", lambda m, h: rows.append(h.shape[1]) or head(m, h))
    got = runner.last_logits(model, make_cache(model, shallow.kv), ids)
    assert rows == [1] and len(ids) > 8
    assert float(mx.abs(got - want).max()) < 1e-4
