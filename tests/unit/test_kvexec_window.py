"""The float window (KVConfig.float_pages): every query reads its own page and the previous one in full
precision whatever the chunking, older pages as stored; the copies are bounded, counted and droppable."""

import mlx.core as mx
import numpy as np
import pytest

from justfit.config import KVConfig
from justfit.kvexec import PagePool, Sequence, attention
from justfit.kvexec.cache import PagedKVCache

P, H, D = 32, 2, 64


def _cache(float_pages=1):
    kv = KVConfig(bits=4, page_size=P, quantized_kv_start=0, float_pages=float_pages)
    return PagedKVCache(Sequence(PagePool(1, P)), 0, kv)


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    return [mx.array(rng.standard_normal((1, H, n, D)).astype(np.float32)) for _ in "kvq"]


def _feed(cache, k, v, sizes):
    at = 0
    for n in sizes:
        cache.update_and_fetch(k[:, :, at : at + n], v[:, :, at : at + n])
        at += n


def _expected(cache, k, v, q, t):
    """Attention of the query at position t built independently: pages before t's previous page decoded
    from their stored 4-bit parts, the previous page's float copy rounded to the 16-bit storage dtype, and
    t's own page (the open one) exact: it is held in the dtype K/V arrive in."""
    ks, vs = [], []
    ck, cv = cache.codecs
    for s, n, page in cache.pages():
        if s // P < t // P - 1:
            assert page.kind == "q"
            kp, vp = page.parts()
            ks.append(ck.decode(kp)[:, :n])
            vs.append(cv.decode(vp)[:, :n])
        else:
            own = s // P == t // P
            ks.append(k[0, :, s : s + n] if own else k[0, :, s : s + n].astype(mx.bfloat16).astype(mx.float32))
            vs.append(v[0, :, s : s + n] if own else v[0, :, s : s + n].astype(mx.bfloat16).astype(mx.float32))
    kk, vv = mx.concatenate(ks, axis=1)[:, : t + 1], mx.concatenate(vs, axis=1)[:, : t + 1]
    p = mx.softmax((q[0, :, t : t + 1] * 0.125) @ kk.swapaxes(-1, -2), axis=-1)
    return p @ vv


@pytest.mark.parametrize("sizes", [[1] * 150, [7] * 21 + [3], [100, 50], [150]], ids=["tokens", "7s", "100+50", "one"])
def test_decode_reads_own_and_previous_page_in_float_whatever_the_chunking(sizes):
    k, v, q = _data(151)
    cache = _cache()
    _feed(cache, k, v, sizes)
    cache.update_and_fetch(k[:, :, 150:151], v[:, :, 150:151])  # a decode step at position 150 (page 4)
    got = attention.paged_attention(q[:, :, 150:151], cache, 0.125)[0]
    want = _expected(cache, k, v, q, 150)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5, rtol=1e-4)
    assert sorted(cache.recent) == [3]  # only the previous page keeps a copy once decode starts


def test_the_window_changes_what_attention_reads_and_dropping_it_restores_the_stored_pages():
    k, v, q = _data(151, seed=1)
    with_window, without = _cache(1), _cache(0)
    for c in (with_window, without):
        _feed(c, k, v, [150, 1])
    a = attention.paged_attention(q[:, :, 150:151], with_window, 0.125)
    b = attention.paged_attention(q[:, :, 150:151], without, 0.125)
    assert float(mx.abs(a - b).max()) > 1e-4  # the previous page really is read from its float copy
    assert with_window.window_nbytes > 0 and without.window_nbytes == 0 and not without.recent
    pages = [c.nbytes - c.memo.nbytes - c.window_nbytes for c in (with_window, without)]  # decode memo: decode.py
    assert pages[0] == pages[1] and with_window.nbytes == pages[0] + with_window.window_nbytes + with_window.memo.nbytes
    with_window.drop_window()
    assert with_window.window_nbytes == 0
    assert mx.array_equal(attention.paged_attention(q[:, :, 150:151], with_window, 0.125), b)


def test_window_copies_stay_bounded_during_decode():
    k, v, _ = _data(12 * P)
    cache = _cache()
    most = 0
    for t in range(12 * P):
        cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        most = max(most, len(cache.recent))
        assert all(i >= t // P - 1 for i in cache.recent)
    assert most == 2  # the previous page, plus the page that just sealed until the next step


def test_trim_into_a_sealed_page_reopens_it_from_its_float_copy():
    k, v, _ = _data(2 * P + 1)
    cache = _cache()
    _feed(cache, k, v, [2 * P])
    cache.trim(5)  # back into page 1, sealed and quantized, with a float copy
    cache.update_and_fetch(k[:, :, 2 * P - 5 : 2 * P - 4], v[:, :, 2 * P - 5 : 2 * P - 4])
    page = cache.pages()[1][2]
    assert page.kind == "open" and 1 not in cache.recent
    kb = page.parts()[0][0][:, : P - 4]
    kept = k[0, :, P : 2 * P - 5].astype(mx.bfloat16).astype(kb.dtype)  # from the copy (16-bit storage dtype)
    want = mx.concatenate([kept, k[0, :, 2 * P - 5 : 2 * P - 4]], axis=1)  # then the token just written, exact
    assert mx.array_equal(kb, want)  # the reopened tokens are the float ones, not their 4-bit codes


def test_a_long_chunk_keeps_its_copies_only_while_its_queries_read_them():
    k, v, q = _data(10 * P + 5)
    cache = _cache()
    cache.update_and_fetch(k, v)  # one chunk seals 10 pages: its queries need all their copies
    assert sorted(cache.recent) == list(range(10))
    attention.paged_attention(q, cache, 0.125, "causal")
    assert sorted(cache.recent) == [9]  # after its attention, only the next token's previous page
