"""PhaseSwap inside the Runtime on the real default model: tool-phase release and exact continuation,
speculative greedy == plain greedy, budget refusal, residency report."""

import mlx.core as mx
import pytest

from justfit.errors import MemoryBudgetError

FILE = "def area(w, h):\n    return w * h\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"
PROMPT = f"Here is shapes.py:\n```python\n{FILE}```\nRepeat shapes.py exactly."


@pytest.fixture
def rt(runtime16):
    yield runtime16
    runtime16.set_drafter("prompt-lookup")
    runtime16.phaseswap.budget.limit = None
    runtime16.phaseswap.enter("idle")


def two_turns(rt, release: bool):
    """Turn 1, optional tool phase (weights + KV released), turn 2 continuing the same cache."""
    cache = rt.make_cache()
    first = rt.encode(PROMPT)
    out1 = [c.token for c in rt.stream_tokens(first, cache, max_tokens=6) if c.token >= 0]
    name = f"kv:test-{release}"
    rt.phaseswap.add_cache(name, cache, rt.home / "spill")
    released = active = 0
    if release:
        before = mx.get_active_memory()
        with rt.tool_phase() as released:
            active = before - mx.get_active_memory()  # freed: other tests' arrays may stay alive
            assert not rt.phaseswap.components[name].resident
            assert not any(c["resident"] for c in rt.residency()["components"])
    second = first + out1 + rt.tokenizer.encode("\nThanks. Now only the first line:", add_special_tokens=False)
    out2 = [c.token for c in rt.stream_tokens(second, cache, max_tokens=6, reused_tokens=cache[0].offset)
            if c.token >= 0]
    stats = rt.last_stats.as_dict()
    rt.phaseswap.remove(name)
    return out1, out2, released, active, stats


def test_tool_phase_release_then_bit_identical_continuation(rt):
    rt.set_drafter("none")
    ref = two_turns(rt, release=False)
    weights = sum(c.size() for c in rt.phaseswap.components.values())
    got = two_turns(rt, release=True)
    assert got[0] == ref[0] and got[1] == ref[1]
    assert got[2] >= weights  # every weight byte (and the KV) was released
    assert got[3] >= 0.95 * weights  # MLX active memory fell by (almost) all the weights
    assert got[4]["reload_s"] > 0 and ref[4]["reload_s"] == 0
    assert rt.residency()["phase"] == "idle"


def test_speculative_greedy_equals_plain_on_default_model(rt):
    rt.set_drafter("none")
    plain = rt.generate(PROMPT, max_tokens=24)
    rt.set_drafter("prompt-lookup")
    spec = rt.generate(PROMPT, max_tokens=24)
    s = spec.stats.as_dict()
    print(f"\nprompt-lookup on the default model: {s['accepted_tokens']}/{s['drafted_tokens']} accepted "
          f"in {s['draft_passes']} passes; plain {plain.stats.decode_tok_s:.1f} tok/s, "
          f"speculative {s['decode_tok_s']:.1f} tok/s")
    assert spec.tokens == plain.tokens
    assert s["drafter"] == "prompt-lookup" and s["drafted_tokens"] > 0 and s["accepted_tokens"] > 0


def test_budget_refusal_is_a_clear_error(rt):
    rt.phaseswap.enter("tool")
    rt.phaseswap.release()
    rt.phaseswap.budget.limit = 100 * 10**6  # the default model needs ~540 MB resident in fp32
    with pytest.raises(MemoryBudgetError) as e:
        rt.generate("Hi", max_tokens=2)
    msg = str(e.value)
    # a 1-token prompt goes through the whole model in one pass: the first phase is prefill-last
    assert "phase 'prefill" in msg and "budget 100.0 MB" in msg and "layers.0-5" in msg
    rt.phaseswap.budget.limit = None
    assert rt.generate("Hi", max_tokens=2).tokens  # fits again once the budget allows it


def test_residency_report(rt):
    rt.ensure_resident()
    r = rt.residency()
    names = {c["name"] for c in r["components"]}
    assert {"embed", "norm"} <= names and any(n.startswith("layers.") for n in names)
    embed = next(c for c in r["components"] if c["name"] == "embed")
    assert set(embed["roles"]) == {"input-embedding", "lm-head"}  # SmolLM2 ties its embeddings
    assert r["phase"] == "resident" and r["resident_bytes"] > 0
