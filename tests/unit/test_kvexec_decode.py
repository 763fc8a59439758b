"""Single-query decode on the stacked-pages memo (kvexec/decode.py): same output as the general paged path, the
memo built once per seal and reused, bounded by MEMO_TOKENS, freed when a trim cuts a sealed page, counted."""

import mlx.core as mx
import numpy as np
import pytest

from justfit.config import KVConfig
from justfit.kvexec import PagePool, Sequence, attention, decode
from justfit.kvexec.cache import PagedKVCache

P, H, D = 32, 2, 64
CONFIGS = {
    "default": dict(),
    "no-window": dict(float_pages=0),
    "rotated": dict(format="rotated"),
    "8-bit-keys": dict(key_bits=8),
    "fp16": dict(bits=16),
}


def _cache(**kw):
    kv = KVConfig(**{"page_size": P, "quantized_kv_start": P, **kw})
    return PagedKVCache(Sequence(PagePool(1, P)), 0, kv)


def _kvq(n, seed=0):
    rng = np.random.default_rng(seed)
    k, v = (mx.array(rng.standard_normal((1, H, n, D)).astype(np.float32)) for _ in "kv")
    return k, v, mx.array(rng.standard_normal((1, 2 * H, 1, D)).astype(np.float32))


def _general(q, cache):
    return attention._attend(q, cache, 0.125, None, None)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("n", [5, 33, 100, 200])
def test_decode_path_equals_the_general_path(name, n):
    k, v, q = _kvq(n + 1)
    cache = _cache(**CONFIGS[name])
    cache.update_and_fetch(k[:, :, :n], v[:, :, :n])
    cache.update_and_fetch(k[:, :, n:], v[:, :, n:])  # the decode step's own token
    assert decode.applies(q, cache, None, None)
    got = decode.attention(q, cache, 0.125)
    assert got is not None
    np.testing.assert_allclose(np.array(got), np.array(_general(q, cache)), atol=2e-6, rtol=1e-5)
    quantized = any(p.kind == "q" for _, _, p in cache.attended_pages())
    assert ("q" in cache.memo.runs) == quantized  # the 4-bit pages were read through the memo


def test_memo_is_built_once_per_seal_and_reused_between():
    k, v, q = _kvq(200)
    cache = _cache()
    cache.update_and_fetch(k[:, :, :130], v[:, :, :130])
    parts = []
    for t in range(130, 200):  # crosses the seals at 160 and 192
        cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        mx.eval(attention.paged_attention(q, cache, 0.125))
        parts.append(cache.memo.runs["q"][1])
    rebuilt = sum(a is not b for a, b in zip(parts, parts[1:]))
    assert rebuilt == 2  # one new stack per sealed page, the same arrays at every other step
    held = cache.memo.runs["q"][0]
    assert len(held) == 4 and all(p.kind == "q" for p in held)  # pages 1-4 (0 full precision, 5 in the window, 6 open)


def test_memo_is_counted_and_freed_when_a_trim_cuts_a_sealed_page():
    k, v, q = _kvq(200)
    cache = _cache()
    cache.update_and_fetch(k[:, :, :199], v[:, :, :199])
    cache.update_and_fetch(k[:, :, 199:], v[:, :, 199:])
    pages_only = cache.nbytes
    mx.eval(attention.paged_attention(q, cache, 0.125))
    assert cache.memo.nbytes > 0 and cache.nbytes == pages_only + cache.memo.nbytes
    cache.trim(4)  # inside the open page: the sealed pages, and so the memo, stay
    assert cache.memo.nbytes > 0
    cache.trim(40)  # into a sealed page
    assert cache.memo.nbytes == 0


def test_contexts_past_the_memo_bound_take_the_general_path(monkeypatch):
    monkeypatch.setattr(decode, "MEMO_TOKENS", 2 * P)
    k, v, q = _kvq(200)
    cache = _cache()
    cache.update_and_fetch(k[:, :, :200], v[:, :, :200])
    assert not decode.applies(q, cache, None, None)
    want = _general(q, cache)  # before paged_attention settles the float window
    out = attention.paged_attention(q, cache, 0.125)
    assert cache.memo.nbytes == 0
    np.testing.assert_allclose(np.array(out), np.array(want), atol=1e-6)


def test_partial_sealed_page_after_a_trim_falls_back():
    k, v, q = _kvq(200)
    cache = _cache(float_pages=0)
    cache.update_and_fetch(k[:, :, :200], v[:, :, :200])
    cache.trim(50)  # 150 tokens: page 4 sealed but cut to 22 of its 32 tokens, no write yet
    assert decode.attention(q, cache, 0.125) is None
    np.testing.assert_allclose(np.array(attention.paged_attention(q, cache, 0.125)), np.array(_general(q, cache)),
                               atol=1e-6)


def test_a_kv_spill_frees_the_memo_and_decode_after_reload_is_unchanged(tmp_path):
    from justfit.phaseswap.kvspill import cache_component

    k, v, q = _kvq(200)
    cache = _cache()
    cache.update_and_fetch(k[:, :, :199], v[:, :, :199])
    cache.update_and_fetch(k[:, :, 199:], v[:, :, 199:])
    before = attention.paged_attention(q, cache, 0.125)
    mx.eval(before)
    assert cache.memo.nbytes > 0
    component = cache_component("s", [cache], tmp_path)
    component.unload()
    assert cache.memo.nbytes == 0  # the stacks would otherwise keep the spilled pages in memory
    component.load()
    assert mx.array_equal(attention.paged_attention(q, cache, 0.125), before)


def test_a_long_quantized_run_is_split_across_streams_and_regrouped_after_a_trim(monkeypatch):
    from justfit.kvexec import streams

    monkeypatch.setattr(streams, "MAX_PARTS", 2)
    monkeypatch.setattr(streams, "SPLIT_ELEMENTS", 3 * 2 * H * P)  # two parts from 6 quantized pages on
    k, v, q = _kvq(301)
    cache = _cache()
    cache.update_and_fetch(k[:, :, :300], v[:, :, :300])
    cache.update_and_fetch(k[:, :, 300:], v[:, :, 300:])
    got = decode.attention(q, cache, 0.125)
    np.testing.assert_allclose(np.array(got), np.array(_general(q, cache)), atol=2e-6, rtol=1e-5)
    first, second = cache.memo.runs["q"][0], cache.memo.runs[("q", 1)][0]
    assert len(first) + len(second) == 7 and abs(len(first) - len(second)) <= 1  # pages 1-7, balanced
    cache.trim(141)  # back to 160 tokens: 4 quantized pages, one part (the trim cleared the split memo)
    cache.update_and_fetch(k[:, :, 160:161], v[:, :, 160:161])
    got = decode.attention(q, cache, 0.125)
    np.testing.assert_allclose(np.array(got), np.array(_general(q, cache)), atol=2e-6, rtol=1e-5)
    assert ("q", 1) not in cache.memo.runs and len(cache.memo.runs["q"][0]) == 4
