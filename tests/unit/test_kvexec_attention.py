"""Paged attention equals plain softmax attention on the dequantized cache, for every format and layout."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from justfit.config import KVConfig
from justfit.kvexec import PagePool, Sequence, attention, decode, softmax, streams
from justfit.kvexec.cache import PagedKVCache, PagedMask

FORMATS = [dict(bits=16), dict(bits=8), dict(bits=4), dict(bits=4, group_size=32), dict(bits=4, format="rotated"),
           dict(bits=4, key_format="rotated"), dict(bits=4, key_bits=8), dict(bits=4, key_format="channel")]  # quality levers: mixed key/value codecs


def _cache(kv, poison=True):
    c = PagedKVCache(Sequence(PagePool(1, kv.page_size)), 0, kv)
    c.poison = poison  # fresh page slots are NaN: reading one would poison the output
    return c


def reference(q, k, v, scale, window=None, sinks=None):
    """Plain attention over dense K/V [1, H, S, D] with causal (+window) mask, GQA by repetition."""
    _, Hq, L, _ = q.shape
    S, rep = k.shape[2], Hq // k.shape[1]
    k, v = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
    s = (q * scale) @ k.swapaxes(-1, -2)
    qpos, kpos = mx.arange(S - L, S)[:, None], mx.arange(S)[None]
    ok = kpos <= qpos
    if window is not None:
        ok = ok & (kpos > qpos - window)
    s = mx.where(ok, s, -float("inf"))
    if sinks is not None:
        s = mx.concatenate([mx.broadcast_to(sinks.reshape(1, Hq, 1, 1), (1, Hq, L, 1)), s], axis=-1)
    p = mx.softmax(s, axis=-1)
    return p[..., -S:] @ v


def _check(cache, q, scale=0.125, window=None, sinks=None, atol=2e-4):
    k, v = cache.dense_kv()
    mask = PagedMask(window) if window else None
    out = attention.paged_attention(q, cache, scale, mask, sinks)
    ref = reference(q, k, v, scale, window, sinks)
    assert not mx.isnan(out).any(), "read an unwritten (poisoned) slot"
    np.testing.assert_allclose(np.array(out), np.array(ref), atol=atol, rtol=1e-3)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fmt=st.sampled_from(FORMATS),
    page=st.sampled_from([32, 64]),
    hkv=st.sampled_from([1, 2, 3]),
    rep=st.sampled_from([1, 2, 3, 4]),
    d=st.sampled_from([64, 80, 128]),
    chunks=st.lists(st.integers(1, 90), min_size=1, max_size=5),
    rewind=st.integers(0, 70),
    tail=st.integers(1, 8),
    float_pages=st.sampled_from([0, 1]),
    start=st.sampled_from([0, 0, 40]),
    seed=st.integers(0, 1000),
)
def test_paged_attention_matches_reference(fmt, page, hkv, rep, d, chunks, rewind, tail, start, seed, float_pages):
    """Random page layouts: chunked appends, partial pages, a rewind, then a 1-8 token verify/decode; with and
    without the float window (dense_kv reads what attention reads)."""
    kv = KVConfig(float_pages=float_pages, page_size=page, quantized_kv_start=start, **fmt)
    cache = _cache(kv)
    rng = np.random.default_rng(seed)

    def append(n):
        k = mx.array(rng.standard_normal((1, hkv, n, d)).astype(np.float32))
        v = mx.array(rng.standard_normal((1, hkv, n, d)).astype(np.float32))
        cache.update_and_fetch(k, v)
        q = mx.array(rng.standard_normal((1, hkv * rep, n, d)).astype(np.float32))
        _check(cache, q)  # the chunk attends to the cached pages plus itself, causally

    for n in chunks:
        append(n)
    cache.trim(rewind)
    assert cache.offset == max(0, sum(chunks) - rewind)
    append(tail)


@pytest.mark.parametrize("fmt", FORMATS[1:], ids=str)
def test_partial_sealed_page_after_a_trim_is_read_as_its_tokens(fmt):
    """A trim leaves the last sealed page partial and still quantized until the next write; a query read
    in between (verification, restore) sees exactly its remaining tokens, for every codec."""
    kv = KVConfig(float_pages=0, page_size=64, quantized_kv_start=0, **fmt)
    cache, rng = _cache(kv), np.random.default_rng(3)
    cache.update_and_fetch(*(mx.array(rng.standard_normal((1, 2, 128, 64)).astype(np.float32)) for _ in "kv"))
    cache.trim(23)
    assert cache.pages()[-1][1] == 41 and cache.pages()[-1][2].kind == "q"
    _check(cache, mx.array(rng.standard_normal((1, 4, 1, 64)).astype(np.float32)))


def test_sliding_window_and_sinks():
    kv = KVConfig(float_pages=0, quantized_kv_start=0, bits=4, page_size=32)
    cache = _cache(kv)
    k = mx.random.normal((1, 2, 150, 64))
    cache.update_and_fetch(k, k * 0.3)
    q = mx.random.normal((1, 4, 3, 64))
    _check(cache, q, window=40)
    _check(cache, q, sinks=mx.array([0.5, -1.0, 2.0, 0.0]))


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_whole_and_online_softmax_agree(fmt, monkeypatch):
    """Decode and short blocks normalize all runs at once (softmax.whole); the online fold that big blocks use
    gives the same output on the same cache (float, quantized and open pages), with sinks or a window too."""
    kv = KVConfig(float_pages=0, page_size=32, quantized_kv_start=32, **fmt)
    cache, rng = _cache(kv), np.random.default_rng(5)
    cache.update_and_fetch(*(mx.array(rng.standard_normal((1, 2, 150, 64)).astype(np.float32)) for _ in "kv"))
    real, calls = softmax.whole, []
    monkeypatch.setattr(softmax, "whole", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(decode, "applies", lambda *a: False)  # one decode query has its own path (test_kvexec_decode)
    for L in (1, 5):
        q = mx.array(rng.standard_normal((1, 4, L, 64)).astype(np.float32))
        for sinks, mask in ((None, None), (mx.array([0.5, -1.0, 2.0, 0.0]), None), (None, PagedMask(48))):
            monkeypatch.setattr(attention, "CHAIN_ELEMENTS", 1 << 20)
            n = len(calls)
            whole = attention.paged_attention(q, cache, 0.125, mask, sinks)
            fused = fmt == dict(bits=16) and mask is None  # every key visible in full precision: MLX's fused attention
            assert len(calls) == n + (not fused)
            monkeypatch.setattr(attention, "CHAIN_ELEMENTS", 0)  # every block too big: run by run
            online = attention.paged_attention(q, cache, 0.125, mask, sinks)
            assert len(calls) == n + (not fused)
            np.testing.assert_allclose(np.array(whole), np.array(online), atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="keys are split across streams on the CPU backend only")
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_keys_split_across_streams_match_reference(fmt, monkeypatch):
    """A block's pages split across parallel CPU streams (streams.py), each part's softmax state merged
    (softmax.Online.merge): the reference output for decode and prefill blocks, with sinks and a window."""
    kv = KVConfig(float_pages=0, page_size=32, quantized_kv_start=32, **fmt)
    cache, rng = _cache(kv), np.random.default_rng(11)
    cache.update_and_fetch(*(mx.array(rng.standard_normal((1, 2, 200, 64)).astype(np.float32)) for _ in "kv"))
    monkeypatch.setattr(streams, "SPLIT_ELEMENTS", 1)  # every block is worth splitting
    monkeypatch.setattr(decode, "applies", lambda *a: False)  # decode past the memo bound takes this path too
    monkeypatch.setattr(streams, "MAX_PARTS", 3)
    used, real = [], streams.on
    monkeypatch.setattr(streams, "on", lambda i: used.append(i) or real(i))
    for L in (1, 7):
        q = mx.array(rng.standard_normal((1, 4, L, 64)).astype(np.float32))
        for sinks, window in ((None, None), (mx.array([0.5, -1.0, 2.0, 0.0]), None), (None, 48)):
            used.clear()
            _check(cache, q, window=window, sinks=sinks)
            fused = fmt == dict(bits=16) and window is None  # all full precision: MLX's fused attention
            assert sorted(set(used)) == ([] if fused else [0, 1, 2])


def test_fast_exp_matches_exp():
    """The compiled polynomial exp of big score blocks: within 1e-5 of MLX's exp, exactly 0 for masked keys,
    NaN kept (a poisoned read must still show)."""
    rng = np.random.default_rng(3)
    s = rng.standard_normal((3, 40, 300)).astype(np.float32) * 30
    s[:, :, ::7] = -np.inf
    s[0, 0, 5] = np.nan
    s = mx.array(s)
    assert s.size >= softmax.FAST_EXP_ELEMENTS
    m = mx.array(np.nanmax(np.array(s), axis=-1, keepdims=True))
    fast, ref = np.array(softmax.exp_shifted(s, m)), np.array(mx.exp(s - m))
    assert (np.isnan(fast) == np.isnan(ref)).all() and np.isnan(fast[0, 0, 5])
    ok = ~np.isnan(ref)
    assert (fast[ok][ref[ok] == 0] == 0).all()  # masked and underflowed keys weigh nothing
    np.testing.assert_allclose(fast[ok], ref[ok], rtol=1e-5, atol=1e-37)


def test_full_precision_pages_use_fused_attention(monkeypatch):
    """While no page is quantized (a short chat, the first pages), MLX's fused attention runs on the pages' float
    K/V: same output as the paged path, with sinks, a window covering every key, and causal prefill blocks."""
    kv = KVConfig(float_pages=0, page_size=32, quantized_kv_start=64)
    cache, rng = _cache(kv), np.random.default_rng(9)
    cache.update_and_fetch(*(mx.array(rng.standard_normal((1, 2, 70, 64)).astype(np.float32)) for _ in "kv"))
    assert {p.kind for _, _, p in cache.pages()} == {"fp", "open"}
    fused, real = [], mx.fast.scaled_dot_product_attention
    monkeypatch.setattr(decode, "applies", lambda *a: False)  # plain decode takes decode.py's path first
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", lambda *a, **k: fused.append(1) or real(*a, **k))
    for L in (1, 6):
        q = mx.array(rng.standard_normal((1, 4, L, 64)).astype(np.float32))
        for sinks, window in ((None, None), (mx.array([0.5, -1.0, 2.0, 0.0]), None), (None, 100)):
            n = len(fused)
            _check(cache, q, window=window, sinks=sinks)
            assert len(fused) == n + 1
    cache.update_and_fetch(*(mx.array(rng.standard_normal((1, 2, 30, 64)).astype(np.float32)) for _ in "kv"))
    n = len(fused)  # a sealed 4-bit page now: the paged path
    _check(cache, mx.array(rng.standard_normal((1, 4, 1, 64)).astype(np.float32)), atol=0.05)
    assert len(fused) == n


def test_window_skips_pages_outside_it():
    cache = _cache(KVConfig(bits=16, page_size=32))
    k = mx.random.normal((1, 1, 200, 64))
    cache.update_and_fetch(k, k)
    first = cache.pages()[0][2]
    first.k = (mx.full(first.k[0].shape, float("nan")),)  # poison a page the window excludes
    q = mx.random.normal((1, 1, 1, 64))
    out = attention.paged_attention(q, cache, 0.125, PagedMask(64))
    assert not mx.isnan(out).any()
    assert mx.isnan(attention.paged_attention(q, cache, 0.125, None)).any()  # without the window it is read


def test_workspace_is_bounded(monkeypatch):
    """Every score block a prefill chunk builds is at most RUN_ELEMENTS, whatever the context length."""
    cache = _cache(KVConfig(float_pages=0, quantized_kv_start=0, bits=4, page_size=32), poison=False)
    k = mx.random.normal((1, 2, 600, 64))
    cache.update_and_fetch(k, k)
    monkeypatch.setattr(attention, "RUN_ELEMENTS", 4 * 64 * 32)  # tiny bound: forces query blocks and runs
    seen = []
    real = attention._attend_block

    def spy(cache_, pages, qb, first, last, window, dense_mask, sinks, run_tokens):
        seen.append(qb.shape[1] * run_tokens * qb.shape[0])
        return real(cache_, pages, qb, first, last, window, dense_mask, sinks, run_tokens)

    monkeypatch.setattr(attention, "_attend_block", spy)
    q = mx.random.normal((1, 4, 200, 64))
    kd, vd = cache.dense_kv()
    out = attention.paged_attention(q, cache, 0.125)
    assert len(seen) > 1 and max(seen) <= 4 * 64 * 32 * 2
    np.testing.assert_allclose(np.array(out), np.array(reference(q, kd, vd, 0.125)), atol=2e-4, rtol=1e-3)


def _lazy_peak(ctx, monkeypatch):
    """Peak bytes over start of one lazily built prefill-sized attention call at context ctx, evaluated once."""
    cache = _cache(KVConfig(float_pages=0, quantized_kv_start=0, bits=4, page_size=64), poison=False)
    k = mx.random.normal((1, 1, ctx, 64))
    cache.update_and_fetch(k, k)
    mx.eval(cache.state)
    monkeypatch.setattr(attention, "RUN_ELEMENTS", 1 << 16)
    monkeypatch.setattr(attention, "CHAIN_ELEMENTS", 1 << 14)
    q = mx.random.normal((1, 4, 256, 64))
    mx.eval(q)
    mx.clear_cache()
    mx.reset_peak_memory()
    start = mx.get_active_memory()
    out = attention.paged_attention(q, cache, 0.125)  # nothing runs until the eval: the graph is lazy
    mx.eval(out)
    return mx.get_peak_memory() - start


def test_lazy_workspace_is_flat_in_context(monkeypatch):
    """Runs are chained, not evaluated one by one, so the graph stays lazy and yet its peak does not grow with
    the number of runs (without the chain all score blocks of a block are alive together: 4x more here)."""
    small, large = _lazy_peak(2048, monkeypatch), _lazy_peak(8192, monkeypatch)
    assert large < 1.5 * small + (1 << 20), (small, large)


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="keys are split across streams on the CPU backend only")
def test_split_attention_runs_on_a_thread_other_than_the_one_that_made_its_streams(monkeypatch):
    """The server steps the engine on its worker thread while the first split may have happened on another
    (a warm-up, a test): the part streams must work on every thread (MLX streams can belong to one thread)."""
    import threading

    kv = KVConfig(float_pages=0, page_size=32, quantized_kv_start=32, bits=4)
    cache, rng = _cache(kv), np.random.default_rng(5)
    cache.update_and_fetch(*(mx.array(rng.standard_normal((1, 2, 200, 64)).astype(np.float32)) for _ in "kv"))
    monkeypatch.setattr(streams, "SPLIT_ELEMENTS", 1)
    monkeypatch.setattr(decode, "applies", lambda *a: False)
    monkeypatch.setattr(streams, "MAX_PARTS", 3)
    q = mx.array(rng.standard_normal((1, 4, 1, 64)).astype(np.float32))
    _check(cache, q)
    errors = []

    def other():
        try:
            _check(cache, q)
        except Exception as e:  # noqa: BLE001 - reported to the main thread
            errors.append(e)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert not errors, errors
