"""Property: 16 concurrent requests with random lengths, sampling, stops, cancellations and a KV budget
that forces preemption, for a few hundred steps: page references always match the running sequences'
block tables, every request ends, and the pool is empty at the end (no leak)."""

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from justfit.config import KVConfig
from justfit.kvexec import make_cache
from justfit.kvexec.pages import PagePool
from justfit.engine import Engine

KV = KVConfig(bits=4, page_size=32, quantized_kv_start=32)


@pytest.fixture(scope="module")
def tiny(runtime16):
    """A 2-layer random-weight llama (fast steps) with the default model's real tokenizer."""
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=49152,
                           rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=4096)
    mx.random.seed(0)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model, runtime16.tokenizer


def _check_refs(pool, eng):
    tables = {}
    for r in eng.scheduler.running:
        for pid in r.caches[0].seq.table:
            tables[pid] = tables.get(pid, 0) + 1
    assert pool.refs == tables  # every reference belongs to a running sequence, and only once per table


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow])
@given(data=st.data())
def test_random_traffic_never_leaks_pages(tiny, data):
    model, tok = tiny
    pool = PagePool(2, KV.page_size)
    budget = data.draw(st.sampled_from([None, 12 * 2 * 32 * 2 * 2 * 16 * 4]), label="budget")  # 12 open pages
    eng = Engine(model, tok, lambda: make_cache(model, KV, pool=pool), kv=KV, step_tokens=64, budget_bytes=budget)
    reqs = []
    steps = data.draw(st.integers(150, 300), label="steps")
    for _ in range(steps):
        live = [r for r in reqs if not r.done]
        if len(live) < 16 and data.draw(st.booleans()):
            n = data.draw(st.integers(1, 120))
            start = data.draw(st.integers(0, 49000))
            reqs.append(eng.submit([(start + 7 * i) % 49152 for i in range(n)],
                                   max_tokens=data.draw(st.integers(1, 40)),
                                   temperature=data.draw(st.sampled_from([0.0, 0.9])),
                                   seed=data.draw(st.sampled_from([None, 1, 2])),
                                   stop=data.draw(st.sampled_from([[], ["e"], ["the", "\n"]]))))
        if live and data.draw(st.integers(0, 19)) == 0:
            data.draw(st.sampled_from(live)).cancel()
        eng.step()
        _check_refs(pool, eng)
        for r in reqs:
            if r.done:
                list(r)  # drain
    for r in reqs:
        g = r.result()
        assert r.done and len(g.tokens) <= r.max_tokens
        assert r.finish_reason in ("stop", "length", "cancelled")
        if r.finish_reason == "length":
            assert len(g.tokens) == r.max_tokens
    assert eng.idle() and pool.refs == {} and all(not layer for layer in pool.records)
