"""Paged attention with a bounded workspace: page run by page run, merged with an online softmax.

Queries (1 to 8 for decode/verification, a whole chunk for prefill) are split into blocks and, for each
block, the layer's pages are read in runs of consecutive pages of one storage kind. Each run is scored
directly on its stored format (formats.py) and folded into running (max, sum, output) accumulators, so
the extra memory per layer is O(heads x query block x run), independent of context length: no B x H x L x S
score matrix and no dequantized copy of the whole cache ever exists. Pages a query block cannot see
(after its last query, or before its sliding window) are skipped, never read.
"""

from typing import Optional

import mlx.core as mx

from . import kernels
from .cache import PagedKVCache, PagedMask
from .pages import QUANT

RUN_ELEMENTS = 1 << 22  # bound on one run's score block (heads x queries x keys), 16 MiB in float32
MAX_RUN_TOKENS = 8192  # longest run of keys read at once
CHAIN_ELEMENTS = 1 << 20  # score blocks this big are chained: a run's reads wait for the previous run's sums


def paged_attention(queries, cache: PagedKVCache, scale: float, mask=None, sinks: Optional[mx.array] = None):
    """softmax(q k^T * scale + mask) v over the cache's pages; queries [1, Hq, L, D] -> [1, Hq, L, Dv]."""
    o = kernels.attention(queries, cache, scale, mask, sinks)  # Metal kernels when they apply
    if o is not None:
        return o
    _, Hq, L, _ = queries.shape
    H = cache.n_kv_heads
    rep, P = Hq // H, cache.seq.page_size
    window = mask.window if isinstance(mask, PagedMask) else cache.window
    dense_mask = mask if isinstance(mask, mx.array) else None
    q = (queries[0].astype(mx.float32) * scale).reshape(H, rep, L, -1)
    q_first = cache.offset - L  # absolute position of query 0
    block = max(1, RUN_ELEMENTS // (Hq * P))
    out = []
    for l0 in range(0, L, block):
        l1 = min(L, l0 + block)
        run_tokens = min(MAX_RUN_TOKENS, max(P, RUN_ELEMENTS // (Hq * (l1 - l0)) // P * P))
        qb = q[:, :, l0:l1].reshape(H, rep * (l1 - l0), -1)
        if out:  # several blocks only in a long prefill: one block at a time, as runs are (see _attend_block)
            qb = mx.depends(qb, out[-1])
        sub = None if dense_mask is None else _mask_block(dense_mask, Hq, H, l0, l1)
        o = _attend_block(cache, qb, q_first + l0, q_first + l1 - 1, window, sub, sinks, run_tokens)
        out.append(o.reshape(H, rep, l1 - l0, -1))
    o = out[0] if len(out) == 1 else mx.concatenate(out, axis=2)
    return o.reshape(1, Hq, L, -1).astype(queries.dtype)


def _mask_block(mask, Hq, H, l0, l1):
    m = mask[..., l0:l1, :]
    m = mx.broadcast_to(m.reshape((1,) * (4 - m.ndim) + m.shape)[0], (Hq, l1 - l0, m.shape[-1]))
    return m.reshape(H, -1, m.shape[-1])


def _visible_pages(cache, first, last, window):
    """Pages at least one query in [first, last] can see: causal, and inside the window if any."""
    lo = 0 if window is None else first - window + 1
    return [(s, n, p) for s, n, p in cache.pages() if s <= last and s + n - 1 >= lo]


def _runs(pages, run_tokens):
    """Group consecutive pages of the same storage kind into runs of at most run_tokens keys."""
    runs, cur = [], []
    for s, n, page in pages:
        quant = page.kind == QUANT
        if cur and (quant != (cur[0][2].kind == QUANT) or sum(c[1] for c in cur) + n > run_tokens):
            runs.append(cur)
            cur = []
        cur.append((s, n, page))
    return runs + [cur] if cur else runs


def _concat(pages, codec, which, page_size):
    """One run's stored parts (K or V) concatenated along the token axis, a partial page cut by its codec.

    Only the cache's last page can be partial, so whole-group padding a codec keeps sits at the run's end."""
    parts = [page.parts()[which] for _, _, page in pages]
    cut = [codec.take(ps, n) if n < page_size else ps for (_, n, _), ps in zip(pages, parts)]
    if len(cut) == 1:
        return cut[0]
    return tuple(mx.concatenate(list(col), axis=1) for col in zip(*cut))


def _attend_block(cache, qb, first, last, window, dense_mask, sinks, run_tokens):
    H, M, _ = qb.shape
    rows = last - first + 1
    if sinks is None:
        m = mx.full((H, M, 1), -float("inf"))
        l = mx.zeros((H, M, 1))
    else:
        m = mx.broadcast_to(sinks.astype(mx.float32).reshape(H, -1, 1, 1), (H, M // rows, rows, 1)).reshape(H, M, 1)
        l = mx.ones((H, M, 1))
    acc, prepared, chain = {}, {}, []
    for run in _runs(_visible_pages(cache, first, last, window), run_tokens):
        ck, cv = cache.codec(run[0][2])
        if id(ck) not in prepared:
            prepared[id(ck)] = ck.prepare(qb)
        P, T = cache.seq.page_size, sum(n for _, n, _ in run)
        qx, keys = prepared[id(ck)], _concat(run, ck, 0, P)
        if chain:  # big blocks (prefill): this run is read only once the previous one is folded in, so
            # one run's scores are alive at a time, and the graph stays lazy (an unused output costs nothing)
            qx, keys = mx.depends(qx, chain), tuple(mx.depends(list(keys), chain))
        s = ck.scores(qx, keys)[..., :T].astype(mx.float32)
        k0 = run[0][0]
        allowed = _allowed(k0, T, first, last, window, M // rows)
        if dense_mask is not None:
            dm = dense_mask[..., k0 : k0 + T]
            if dm.dtype == mx.bool_:
                allowed = dm if allowed is None else allowed & dm
            else:
                s = s + dm
        if allowed is not None:
            s = mx.where(allowed, s, -float("inf"))
        m_new = mx.maximum(m, s.max(axis=-1, keepdims=True))
        m_safe = mx.where(m_new == -float("inf"), 0.0, m_new)
        p = mx.exp(s - m_safe)
        alpha = mx.exp(m - m_safe)
        l = l * alpha + p.sum(axis=-1, keepdims=True)
        for key in acc:
            acc[key] = (acc[key][0], acc[key][1] * alpha)
        o_run = cv.mix(p, _concat(run, cv, 1, P))
        if id(cv) in acc:
            acc[id(cv)] = (cv, acc[id(cv)][1] + o_run)
        else:
            acc[id(cv)] = (cv, o_run)
        m = m_new
        if s.size >= CHAIN_ELEMENTS:
            chain = [m, l, *(a for _, a in acc.values())]
    o = None
    for cv, a in acc.values():
        o = cv.finish(a) if o is None else o + cv.finish(a)
    if o is None:  # nothing visible (only possible with an all-masking dense mask)
        return mx.zeros((H, M, cache.value_dim))
    return o / mx.maximum(l, 1e-30)


def _allowed(k0, T, first, last, window, rep):
    """[rep*rows, T] bool of keys each query may see, or None when the whole run is visible to all."""
    k_last = k0 + T - 1
    if k_last <= first and (window is None or k0 > last - window):
        return None
    kpos = mx.arange(k0, k0 + T)
    qpos = mx.arange(first, last + 1)[:, None]
    ok = kpos[None] <= qpos
    if window is not None:
        ok = ok & (kpos[None] > qpos - window)
    return mx.broadcast_to(ok[None], (rep, last - first + 1, T)).reshape(rep * (last - first + 1), T)
