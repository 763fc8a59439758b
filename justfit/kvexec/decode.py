"""Single-query decode on few ops: a short context's sealed pages kept stacked between seals.

Decoding one token at a short context is bound by the number of MLX ops per layer more than by bytes (a CPU
op costs ~5-10 us to dispatch; a layer's attention reads a few hundred KB). The general path (attention.py)
concatenates and widens every quantized page's parts again at every step and scores each run apart, on
parallel streams past ~1k keys. Here a layer's sealed quantized pages are concatenated and their 16-bit
scales widened once, when a page seals (`RunMemo`), and so are its sealed float pages (the first
full-precision page and the float window's copy); the open page is the third run, one plain softmax
over all. Past ~1.1k quantized keys the quantized run is cut in two, each half scored and mixed on its own
CPU stream (streams.py) under the same softmax: MLX's CPU `quantized_matmul` is a one-thread kernel, and at
2k tokens it is most of the step (benchmarks/repro/decode_2k_profile.py, decode_split_ab.py). The memo is
a second copy of at most `MEMO_TOKENS` quantized tokens and of the float window's pages (default model at
2.5k tokens: 0.9 MB a layer), counted in the cache's `nbytes`; longer contexts take the general path,
where reading bytes costs more than ops.
On x86-64 CPUs `kernel_attention` comes first: once a page is read in 4 bits, at any context, the whole
layer's attention is one call of cpu/q4.c over the pages where they are (the memo then holds only the
kernel's page list, and copies of pages stored strided, counted in `nbytes`).
"""

import mlx.core as mx
import numpy as np

from . import cpu, streams
from .formats import concat_parts
from .pages import FULL, OPEN, QUANT

MEMO_TOKENS = 2048  # most sealed quantized tokens a layer stacks here (longer contexts: attention.py; at
# 3.3k tokens the memo measured no faster than the general path)


class RunMemo:
    """One layer's sealed pages of each kind (quantized, float) concatenated, reused while they stay the same."""

    def __init__(self):
        self.runs: dict = {}  # kind -> (the Page records stacked, held so their ids stay theirs; their parts)
        self.table = None  # (sealed pages, their cpu.PAGE rows, host views, bytes of the views that are copies)

    def get(self, kind: str, pages, codecs):
        """(key parts, value parts) of `pages` (sealed, of one kind, in token order), stacked once; a
        quantized run's 16-bit scales widened to float32 (what every read would cast them to)."""
        held = self.runs.get(kind)
        if held is None or len(held[0]) != len(pages) or any(a is not b for a, b in zip(pages, held[0])):
            parts = tuple(concat_parts([p.parts()[w] for p in pages]) for w in (0, 1))
            if kind != FULL:  # a quantized run (QUANT, or (QUANT, i) for the i-th part of a split one)
                parts = tuple(codec.widened(x, mx.float32) for codec, x in zip(codecs, parts))
            held = self.runs[kind] = (tuple(pages), parts)
        return held[1]

    def clear(self):
        self.runs.clear()
        self.table = None

    def rows(self, pages, build):
        """`build(pages)` -> (rows, views, copied bytes) for the CPU kernel's page list; its rows, kept while
        the sealed pages stay the same objects."""
        held = self.table
        if held is None or len(held[0]) != len(pages) or any(a is not b for a, b in zip(pages, held[0])):
            held = self.table = (tuple(pages), *build(pages))
        return held[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the copies (a run of one page reuses that page's own arrays, which are not counted)."""
        total = 0
        for pages, parts in self.runs.values():
            own = {id(a) for p in pages for side in p.parts() for a in side}
            total += sum(a.nbytes for x in parts for a in x if id(a) not in own)
        return total + (self.table[3] if self.table is not None else 0)  # strided pages the kernel reads copied


def one_query(queries, cache, mask, sinks) -> bool:
    """One causal query: no window, no sinks, no dense mask."""
    if queries.shape[2] != 1 or sinks is not None or cache.window is not None or cache.dense:
        return False
    return mask is None or (isinstance(mask, str) and mask == "causal")


def applies(queries, cache, mask, sinks) -> bool:
    """One causal query on a context whose sealed 4-bit part fits the memo."""
    return one_query(queries, cache, mask, sinks) and cache.offset <= MEMO_TOKENS + \
        cache.kv.quantized_kv_start + (cache.kv.float_pages + 1) * cache.seq.page_size


def kernel_attention(queries, cache, scale: float):
    """One query [1, Hq, 1, D] over every page of the layer in one call of the CPU kernel (cpu/q4.c), at any
    context: sealed 4-bit pages read in place, no stacked copy; or None where it does not apply (another
    format, no page read in 4 bits, a partial sealed page, no kernel here). The caller checked one_query.
    The call evaluates q and the open page: one synchronization a layer, which costs less than MLX's
    quantized matmul from ~1k sealed 4-bit tokens on (benchmarks/repro/cpu_q4_kernel.py)."""
    _, Hq, _, D = queries.shape
    o = kernel_attention_batch(queries.reshape(1, Hq, D), [cache], scale)
    return None if o is None else o.reshape(1, Hq, 1, D).astype(queries.dtype)


def kernel_attention_batch(q, caches, scale: float):
    """One decode query per sequence, q [B, Hq, D] -> [B, Hq, D], each over its own cache's pages in one call
    of the CPU kernel; None where it does not serve every sequence (see _kernel_pages: each must read a
    sealed 4-bit page)."""
    pages = [_kernel_pages(c) for c in caches]
    if any(p is None for p in pages):
        return None
    B, Hq, D = q.shape
    H = caches[0].n_kv_heads
    qf = (q.astype(mx.float32) * scale).reshape(B, H, Hq // H, D)
    mx.eval(qf, *[a for _, open_ in pages if open_ is not None for side in open_[1].parts() for a in side])
    tables, views = [], []  # the open pages' host views: alive until the call returns
    for c, (sealed, open_) in zip(caches, pages):
        rows = c.memo.rows(sealed, lambda ps, c=c: _page_rows(ps, c.seq.page_size))
        if rows is None:
            return None
        if open_ is not None:
            n, page = open_
            (k,), (v,) = page.parts()
            row, held = cpu.page_row(cpu.float_kind(k), n, (k,), (v,))
            rows = np.concatenate([rows, np.array([row], cpu.PAGE)])
            views.append(held)
        tables.append(rows)
    o = cpu.decode(qf, tables, caches[0].seq.page_size)
    del views
    return None if o is None else o.reshape(B, Hq, D)


def kernel_serves(caches) -> bool:
    """True when a decode step over these sequences (one layer cache each) runs the CPU kernel, which evaluates
    its inputs while the step is built: building the next step before reading the pending token then computes
    it first, so the token would be read a step late for no overlap (engine/core.py)."""
    return bool(caches) and all(c.window is None and not c.dense and _kernel_pages(c) is not None for c in caches)


def _kernel_pages(cache):
    """(sealed pages, (n, open page) or None) as the CPU kernel reads them, or None where it does not apply:
    another format, a partial sealed page, an open page in a dtype it does not read, no page read in 4 bits
    (MLX's fused path then costs no synchronization), no kernel here."""
    if not cpu.decodes(*cache.codecs):
        return None
    sealed, open_ = [], None
    for _, n, page in cache.attended_pages():
        if page.kind == OPEN:
            open_ = (n, page)
        elif n < cache.seq.page_size:
            return None
        else:
            sealed.append(page)
    if not any(page.kind == QUANT for page in sealed):
        return None
    if open_ is not None:
        (k,), (v,) = open_[1].parts()
        if cpu.float_kind(k) is None or cpu.float_kind(v) != cpu.float_kind(k):
            return None
    return sealed, open_


def _page_rows(pages, page_size: int):
    """(cpu.PAGE rows of whole sealed pages, the host views they point into, bytes of those that are copies
    of strided arrays), or (None, None, 0) when a page is stored in a dtype the kernel does not read."""
    rows, views = np.zeros(len(pages), cpu.PAGE), []
    mx.eval([a for page in pages for side in page.parts() for a in side])
    for i, page in enumerate(pages):
        k, v = page.parts()
        kind = cpu.QUANT if page.kind == QUANT else cpu.float_kind(k[0])
        if kind is None or (kind != cpu.QUANT and cpu.float_kind(v[0]) != kind):
            return None, None, 0
        rows[i], held = cpu.page_row(kind, page_size, k, v)
        views.extend(x for x in held if x is not None)
    return rows, views, sum(x.nbytes for x in views if x.flags.owndata)


def attention(queries, cache, scale: float):
    """softmax(q k^T * scale) v for one query [1, Hq, 1, D] -> [1, Hq, 1, Dv], or None (the general path runs)
    when a sealed page is partial (a trim inside it) or the sealed 4-bit part outgrew the memo."""
    _, Hq, _, D = queries.shape
    H, P = cache.n_kv_heads, cache.seq.page_size
    quant, sealed, open_ = [], [], None
    for _, n, page in cache.attended_pages():
        if page.kind == OPEN:
            open_ = (n, page)
        elif n < P or (page.kind == QUANT and (len(quant) + 1) * P > MEMO_TOKENS):
            return None
        else:
            (quant if page.kind == QUANT else sealed).append(page)
    q = queries.reshape(H, Hq // H, D).astype(mx.float32) * scale
    scores, values = [], []
    float_memo = len(sealed) <= cache.kv.quantized_kv_start // P + cache.kv.float_pages  # else bits=16: no copy
    for i, kind, pages, (ck, cv) in _runs(quant, sealed, Hq * P, cache):
        if kind != FULL or float_memo:
            kparts, vparts = cache.memo.get(kind, pages, (ck, cv))
        else:  # every page full precision (bits=16): read in place, never copied twice
            kparts, vparts = (concat_parts([p.parts()[w] for p in pages]) for w in (0, 1))
        with streams.on(i):
            scores.append(ck.scores(ck.prepare(q), kparts).astype(mx.float32))
        values.append((i, cv, vparts))
    if open_ is not None:
        n, page = open_
        fk, fv = cache.full
        k, v = (x[0][:, :n].astype(mx.float32) for x in page.parts())
        scores.append(fk.scores(q, (k,)))
        values.append((0, fv, (v,)))
    p = mx.softmax(scores[0] if len(scores) == 1 else mx.concatenate(scores, axis=-1), axis=-1, precise=True)
    o, t0 = None, 0
    for s, (i, cv, parts) in zip(scores, values):
        T = s.shape[-1]
        with streams.on(i):
            x = cv.finish(cv.mix(p if len(scores) == 1 else p[..., t0 : t0 + T], parts))
        o, t0 = x if o is None else o + x, t0 + T
    return o.reshape(1, Hq, 1, -1).astype(queries.dtype)


def _runs(quant, sealed, elements_per_page: int, cache):
    """(stream, memo key, pages, codecs) of each sealed run: the quantized pages cut into token-balanced
    groups, one CPU stream each past streams.SPLIT_ELEMENTS of work a part, then the float pages. The parts
    only get fewer after a trim, which clears the memo, so no stale part stays stacked."""
    runs = []
    if quant:
        groups = streams.balanced(quant, [1] * len(quant), streams.parts(elements_per_page * len(quant)))
        runs += [(i, QUANT if i == 0 else (QUANT, i), g, cache.codecs) for i, g in enumerate(groups)]
    if sealed:
        runs.append((0, FULL, sealed, cache.full))
    return runs
