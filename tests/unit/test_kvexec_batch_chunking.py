"""Batched serving (PagedKVCache.for_batch) keeps no float window, yet what a query reads must not depend
on how its sequence's prompt was cut into chunks: the engine sizes prefill chunks by load and step times, so
otherwise a request's tokens depend on what ran beside it. Every query reads its own page in 16 bits (as it
did while the page was open) and older sealed pages in 4 bits, whether its page sealed in its own chunk, in
an earlier one, or at a decode token; and no float copy outlives the step that sealed its page."""

import mlx.core as mx
import numpy as np
import pytest

from justfit.config import KVConfig
from justfit.kvexec import PagePool, Sequence, attention
from justfit.kvexec.batch import BatchPlan, batch_attention
from justfit.kvexec.cache import PagedKVCache

P, H, REP, D, N = 64, 2, 3, 64, 200


def _batched_cache():
    kv = KVConfig(page_size=P, quantized_kv_start=P)  # the default formats: one full page, then 4-bit pages
    cache = PagedKVCache(Sequence(PagePool(1, P)), 0, kv)
    cache.for_batch()
    return cache


def _data(seed=0):
    rng = np.random.default_rng(seed)
    k, v = (mx.array(rng.standard_normal((1, H, N, D)).astype(np.float32)) for _ in "kv")
    return k, v, mx.array(rng.standard_normal((1, H * REP, N, D)).astype(np.float32))


def _prefill(sizes, seed=0):
    """Every query's attention output [Hq, N, D] with the prompt fed in chunks of `sizes`, each chunk's
    attention computed right after its write (as a forward pass does), and the cache."""
    k, v, q = _data(seed)
    cache, out, at = _batched_cache(), [], 0
    for n in sizes:
        cache.update_and_fetch(k[:, :, at : at + n], v[:, :, at : at + n])
        out.append(attention.paged_attention(q[:, :, at : at + n], cache, 0.125, "causal" if n > 1 else None)[0])
        at += n
    assert at == N and not cache.recent  # the copies went with the chunk that read them
    return mx.concatenate(out, axis=1), cache


@pytest.mark.parametrize("sizes", [[150, 50], [100, 28, 72], [127, 1, 72], [20] * 10], ids=["150+50", "100+28+72",
                                                                                             "seal-at-1", "20s"])
def test_prefill_reads_the_same_whatever_the_chunking(sizes):
    whole, _ = _prefill([N])
    chunked, _ = _prefill(sizes)
    np.testing.assert_allclose(np.array(chunked), np.array(whole), atol=2e-5, rtol=1e-4)


def test_batched_decode_token_that_seals_its_page_reads_it_as_a_prefill_does():
    """Two sequences decoding in one batch (batch_attention: the CPU kernel where it runs, else the batched
    MLX path); the token at position 191 seals page 2 and reads it in 16 bits, as the whole prompt's query
    at 191 does; afterwards no copy is left."""
    whole, _ = _prefill([N])
    k, v, q = _data()
    caches = [_batched_cache(), _batched_cache()]
    for c in caches:
        c.update_and_fetch(k[:, :, :191], v[:, :, :191])
        attention.paged_attention(q[:, :, :191], c, 0.125, "causal")
    plan = BatchPlan([([c], 1) for c in caches])
    plan.layers[0].update_and_fetch(*(mx.concatenate([x[0, :, 191:192].transpose(1, 0, 2)[:, :, None]] * 2)
                                      for x in (k, v)))
    rows = mx.concatenate([q[0, :, 191:192].transpose(1, 0, 2)[:, :, None]] * 2)
    o = batch_attention(rows, plan.layers[0], 0.125)
    for b in range(2):
        np.testing.assert_allclose(np.array(o[b, :, 0]), np.array(whole[:, 191]), atol=2e-5, rtol=1e-4)
    assert not any(c.recent for c in caches)
