"""Paged attention with a bounded workspace: page run by page run, one softmax or an online one.

Queries (1 to 8 for decode/verification, a whole chunk for prefill) are split into blocks and, for each
block, the layer's pages are read in runs of consecutive pages of one storage kind. Each run is scored
directly on its stored format (formats.py). When all of a block's scores fit one small block (decode,
short prefill) they are normalized together in one softmax; otherwise each run is folded into running
(max, sum, output) accumulators (softmax.py). Either way the extra memory per layer is bounded by a
constant, independent of context length: no B x H x L x S score matrix and no dequantized copy of the
whole cache ever exists. Pages a query block cannot see (after its last query, or before its sliding
window) are skipped, never read, so a prefill chunk runs in blocks of a few pages to skip its masked half.
On the CPU a big block's pages are split across parallel streams, one core each (streams.py). While no
page is quantized (a short chat, the first pages of any sequence), MLX's fused attention runs on the
pages' float K/V instead: the same result in a quarter of the ops. One decode query at a short context
runs on decode.py's stacked pages first (fewer ops still); this path serves everything else.
"""

from typing import Optional

import mlx.core as mx

from . import decode, kernels, softmax, streams
from .cache import PagedKVCache, PagedMask
from .formats import concat_parts
from .pages import QUANT

RUN_ELEMENTS = 1 << 22  # bound on one run's score block (heads x queries x keys), 16 MiB in float32
MAX_RUN_TOKENS = 8192  # longest run of keys read at once
CHAIN_ELEMENTS = 1 << 20  # score blocks this big are chained (a run's reads wait for the previous run's sums);
# a block whose scores over all runs are smaller is normalized in one softmax (softmax.whole)


def paged_attention(queries, cache: PagedKVCache, scale: float, mask=None, sinks: Optional[mx.array] = None):
    """softmax(q k^T * scale + mask) v over the cache's pages; queries [1, Hq, L, D] -> [1, Hq, L, Dv]."""
    o = kernels.attention(queries, cache, scale, mask, sinks)  # Metal kernels when they apply
    if o is None and decode.one_query(queries, cache, mask, sinks):
        o = decode.kernel_attention(queries, cache, scale)  # x86-64 CPU: every page in one call (cpu/q4.c)
    if o is None and decode.applies(queries, cache, mask, sinks):
        o = decode.attention(queries, cache, scale)  # one query at a short context: few ops
    if o is None:
        o = _attend(queries, cache, scale, mask, sinks)
    cache.settle_window()  # the graph holds what this chunk read; later queries need fewer float copies
    return o


def _attend(queries, cache: PagedKVCache, scale: float, mask, sinks):
    """paged_attention on KVExec's MLX-ops path."""
    _, Hq, L, _ = queries.shape
    H = cache.n_kv_heads
    rep, P = Hq // H, cache.seq.page_size
    window = mask.window if isinstance(mask, PagedMask) else cache.window
    pages = cache.attended_pages()  # walked once per call: the fused test, then whichever path reads them
    if _fused_applies(cache, pages, mask, window, Hq * L):
        return _attend_full(queries, cache, pages, scale, sinks)
    dense_mask = mask if isinstance(mask, mx.array) else None
    q = (queries[0].astype(mx.float32) * scale).reshape(H, rep, L, -1)
    q_first = cache.offset - L  # absolute position of query 0
    block = min(max(1, RUN_ELEMENTS // (Hq * P)), _block_rows(q_first, L, P))
    own_copies = cache.batched and bool(cache.recent)  # a page this chunk sealed: read as a copy by its own rows only
    out = []
    for l0, l1 in _blocks(q_first, L, block, P if own_copies else None):
        if own_copies:
            pages = cache.attended_pages(q_first + l0)
        run_tokens = min(MAX_RUN_TOKENS, max(P, RUN_ELEMENTS // (Hq * (l1 - l0)) // P * P))
        qb = q[:, :, l0:l1].reshape(H, rep * (l1 - l0), -1)
        if out:  # several blocks only in a long prefill: one block at a time, as runs are (see _attend_block)
            qb = mx.depends(qb, out[-1])
        sub = None if dense_mask is None else _mask_block(dense_mask, Hq, H, l0, l1)
        o = _attend_block(cache, pages, qb, q_first + l0, q_first + l1 - 1, window, sub, sinks, run_tokens)
        out.append(o.reshape(H, rep, l1 - l0, -1))
    o = out[0] if len(out) == 1 else mx.concatenate(out, axis=2)
    return o.reshape(1, Hq, L, -1).astype(queries.dtype)


def _blocks(q_first: int, L: int, block: int, page: Optional[int]):
    """[(l0, l1)] query row ranges of at most `block` rows; none crosses a page boundary when `page` is given
    (each range then reads one own page)."""
    out, l0 = [], 0
    while l0 < L:
        l1 = min(L, l0 + block)
        if page is not None:
            l1 = min(l1, ((q_first + l0) // page + 1) * page - q_first)
        out.append((l0, l1))
        l0 = l1
    return out


def _block_rows(q_first: int, L: int, P: int) -> int:
    """Query rows per block: a block reads only the pages up to its last query, so a chunk split into blocks
    of a page skips most of its causal masked half (less than half the time of whole-prompt blocks on a
    2k prompt); deeper in a long context that half matters less than re-reading the context per block."""
    return P * (1 + q_first // (2 * L))


def _fused_applies(cache, pages, mask, window, rows) -> bool:
    """True when no page is quantized, every key is visible (causal only) and all scores fit the one-softmax
    bound: a short chat, a short prompt's prefill, the first pages of any sequence."""
    if isinstance(mask, mx.array) or (window is not None and cache.offset > window):
        return False
    return fits_one_softmax(rows * (cache.offset + 1)) and all(p.kind != QUANT for _, _, p in pages)


def _attend_full(queries, cache, pages, scale, sinks):
    """Full-precision pages only: MLX's fused attention on their float K/V, 3-4 ops where the paged path
    takes ~15 (ops, not bytes, bound a short decode on the CPU: 185 vs 282 us a layer at 130 tokens)."""
    (ck, cv), P = cache.full, cache.seq.page_size
    k = _concat(pages, ck, 0, P)[0].astype(queries.dtype)  # one run of float pages
    v = _concat(pages, cv, 1, P)[0].astype(queries.dtype)
    causal = "causal" if queries.shape[2] > 1 else None  # queries are the last L positions (a window, if any, covers all)
    return mx.fast.scaled_dot_product_attention(queries, k[None], v[None], scale=scale, mask=causal, sinks=sinks)


def _mask_block(mask, Hq, H, l0, l1):
    m = mask[..., l0:l1, :]
    m = mx.broadcast_to(m.reshape((1,) * (4 - m.ndim) + m.shape)[0], (Hq, l1 - l0, m.shape[-1]))
    return m.reshape(H, -1, m.shape[-1])


def _visible_pages(pages, first, last, window):
    """Pages at least one query in [first, last] can see: causal, and inside the window if any."""
    lo = 0 if window is None else first - window + 1
    return [(s, n, p) for s, n, p in pages if s <= last and s + n - 1 >= lo]


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
    return concat_parts([codec.take(ps, n) if n < page_size else ps for (_, n, _), ps in zip(pages, parts)])


def _attend_block(cache, pages, qb, first, last, window, dense_mask, sinks, run_tokens):
    """One query block over its visible pages: one softmax when all their scores fit, else an online one
    run by run. A big block's pages are split across parallel streams (streams.py), each part's softmax
    state computed on its own and merged; parts run together, so they share the workspace bound."""
    H, M, _ = qb.shape
    visible = _visible_pages(pages, first, last, window)
    sizes = [n for _, n, _ in visible]
    attend = _attend_whole if fits_one_softmax(H * M * (sum(sizes) + 1)) else _attend_online
    parts = streams.balanced(visible, sizes, streams.parts(H * M * sum(sizes)))
    state = streams.merged(parts, lambda i, part: attend(cache, qb, _runs(part, max(1, run_tokens // len(parts))),
                                                         first, last, window, dense_mask, sinks if i == 0 else None))
    return state.result((H, M, cache.value_dim))


def fits_one_softmax(elements: int) -> bool:
    """True when a block's scores over all its runs (heads x query rows x keys) are few enough to normalize in
    one softmax (softmax.whole) within the workspace bound; else they fold run by run (softmax.Online)."""
    return elements <= min(CHAIN_ELEMENTS, RUN_ELEMENTS)


def _run_scores(cache, run, qx, keys, first, last, window, dense_mask, rows):
    """[H, M, T] float32 scores of one run on its stored format, masked (causal, window, dense mask)."""
    ck, _ = cache.codec(run[0][2])
    T, k0 = sum(n for _, n, _ in run), run[0][0]
    s = ck.scores(qx, keys)[..., :T].astype(mx.float32)
    allowed = _allowed(k0, T, first, last, window, qx.shape[1] // rows)
    if dense_mask is not None:
        dm = dense_mask[..., k0 : k0 + T]
        if dm.dtype == mx.bool_:
            allowed = dm if allowed is None else allowed & dm
        else:
            s = s + dm
    return s if allowed is None else mx.where(allowed, s, -float("inf"))


def _prepared(cache, qb, run, memo):
    """The block's queries in the key codec's space, mapped once per codec."""
    ck, _ = cache.codec(run[0][2])
    if id(ck) not in memo:
        memo[id(ck)] = ck.prepare(qb)
    return memo[id(ck)]


def _sink_column(sinks, H, M, rows):
    """[H, M, 1] each query row's attention-sink logit (its head's), a key with no value."""
    return mx.broadcast_to(sinks.astype(mx.float32).reshape(H, -1, 1, 1), (H, M // rows, rows, 1)).reshape(H, M, 1)


def _attend_whole(cache, qb, runs, first, last, window, dense_mask, sinks):
    """All visible keys' scores fit one small block (decode, short prefill): one softmax over them, no
    online merge, so a few ops per run instead of a dozen (ops, not bytes, bound a short decode)."""
    H, M, _ = qb.shape
    if not runs:  # nothing visible
        return softmax.Online(mx.full((H, M, 1), -float("inf")), mx.zeros((H, M, 1)))
    rows, P, memo = last - first + 1, cache.seq.page_size, {}
    scores, values = ([], []) if sinks is None else ([_sink_column(sinks, H, M, rows)], [None])
    for run in runs:
        ck, cv = cache.codec(run[0][2])
        keys = _concat(run, ck, 0, P)
        scores.append(_run_scores(cache, run, _prepared(cache, qb, run, memo), keys, first, last, window, dense_mask, rows))
        values.append((cv, _concat(run, cv, 1, P)))
    return softmax.whole(scores, values)


def _attend_online(cache, qb, runs, first, last, window, dense_mask, sinks):
    """Run by run, folded into running (max, sum, output) accumulators: one run's scores at a time."""
    H, M, _ = qb.shape
    rows, P, memo = last - first + 1, cache.seq.page_size, {}
    if sinks is None:
        fold = softmax.Online(mx.full((H, M, 1), -float("inf")), mx.zeros((H, M, 1)))
    else:
        fold = softmax.Online(_sink_column(sinks, H, M, rows), mx.ones((H, M, 1)))
    chain = []
    for run in runs:
        ck, cv = cache.codec(run[0][2])
        qx, keys = _prepared(cache, qb, run, memo), _concat(run, ck, 0, P)
        if chain:  # big blocks (prefill): this run is read only once the previous one is folded in, so
            # one run's scores are alive at a time, and the graph stays lazy (an unused output costs nothing)
            qx, keys = mx.depends(qx, chain), tuple(mx.depends(list(keys), chain))
        s = _run_scores(cache, run, qx, keys, first, last, window, dense_mask, rows)
        fold.fold(s, cv, _concat(run, cv, 1, P))
        if s.size >= CHAIN_ELEMENTS:
            chain = fold.arrays()
    return fold


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
