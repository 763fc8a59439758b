"""Batched paged attention: one forward pass over B sequences of different lengths, each through its own
page table, with no padding and no copies of a finished sequence's KV.

Layout: every token of the step is a batch row of its own ([T, 1] input ids), so mlx-lm's model code runs
unchanged and RoPE gets one position per row (`BatchLayer.offset` is an array; `mx.fast.rope` takes one).
A `BatchPlan` lists the step's segments (a sequence's per-layer caches and how many rows it owns: 1 for a
decode, a chunk for a prefill). Each layer's `update_and_fetch` writes every segment's K/V into that
sequence's own pages (kvexec/cache.py) and returns `BatchKV` handles; the attention dispatcher
(routing.py) then calls `batch_attention`: prefill segments run the single-sequence bounded-workspace
paged attention on their own pages; all decode segments run together (`_decode_batch`), key run by key run
over their stacked pages with one softmax (an online one, run by run, when the scores are big), so the
workspace stays bounded by `RUN_ELEMENTS`. A step with prompt rows runs the last layer's attention and MLP
for the sampled rows only (`batched_logits` in engine/runner.py): the other rows need nothing of it but their K/V.
A row only ever reads pages of its own sequence's table.
"""

from typing import List, Optional, Sequence as Seq

import mlx.core as mx

from . import softmax, streams
from .attention import RUN_ELEMENTS, fits_one_softmax, paged_attention
from .cache import PagedKVCache
from .decode import kernel_attention_batch
from .formats import concat_parts
from .pages import FULL, OPEN, QUANT


class BatchPlan:
    """One step's rows: segments [(per-layer caches of one sequence, rows)], in row order."""

    def __init__(self, segments: List[tuple], memo: Optional[dict] = None, dequant: bool = True,
                 positions: Optional[mx.array] = None):
        self.segments = [(caches, n) for caches, n in segments if n > 0]
        self.memo = memo  # stacked sealed pages kept across steps by the caller (see _decode_batch)
        self.dequant = dequant  # whether the memo may hold sealed 4-bit pages dequantized (DEQUANT_TOKENS)
        self.masks: dict = {}  # the open pages' masks, the same in every layer of this step (_open_run)
        self.sampled_only = positions is not None  # rows: each segment's last, whose K/V a full plan wrote
        if positions is None:
            first = [c[0].offset for c, _ in self.segments]
            positions = mx.array([s + i for s, (_, n) in zip(first, self.segments) for i in range(n)])
        self.positions = positions
        self.rows = len(self.segments) if self.sampled_only else sum(n for _, n in self.segments)
        n_layers = len(self.segments[0][0]) if self.segments else 0
        self.layers = [BatchLayer(self, i) for i in range(n_layers)]

    def sampled(self) -> "BatchPlan":
        """This plan read-only and cut to its sampled rows (each segment's last), once this plan has written
        the step's K/V: `batched_logits` (engine/runner.py) runs the last layer's attention and MLP through it (_sampled_hidden)."""
        return BatchPlan(self.segments, self.memo, self.dequant, self.positions[mx.array(self.last_rows())])

    def last_rows(self) -> List[int]:
        """Row index of each segment's last token (where its next-token logits are)."""
        out, r = [], 0
        for _, n in self.segments:
            r += n
            out.append(r - 1)
        return out


class BatchKV:
    """Handle standing for one layer's batched keys or values (recognized by the attention dispatcher)."""

    def __init__(self, layer: "BatchLayer"):
        self.layer = layer


class BatchLayer:
    """One layer of a BatchPlan, speaking mlx-lm's cache protocol as far as the model needs it."""

    def __init__(self, plan: BatchPlan, layer: int, attend: bool = True):
        self.plan, self.layer = plan, layer
        self.attend = attend  # False: the layer only writes K/V; its attention output is never computed

    @property
    def offset(self):
        return self.plan.positions  # one RoPE position per row

    def update_and_fetch(self, keys, values):
        if self.plan.sampled_only:  # the full plan wrote these rows' K/V
            return BatchKV(self), BatchKV(self)
        r, rows = 0, {}
        for caches, n in self.plan.segments:
            cache = caches[self.layer]
            if n == 1:  # decode rows: cast into their open pages' dtype and split into [H, 1, D] once a step
                dtype = cache.open_dtype or keys.dtype
                if dtype not in rows:
                    T, H, _, D = keys.shape
                    rows[dtype] = [mx.split(x.astype(dtype).reshape(T * H, 1, -1), T) for x in (keys, values)]
                cache.append(rows[dtype][0][r], rows[dtype][1][r])
            else:
                cache.append(keys[r : r + n, :, 0].transpose(1, 0, 2), values[r : r + n, :, 0].transpose(1, 0, 2))
            r += n
        return BatchKV(self), BatchKV(self)

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        return None  # each segment is causal over its own pages (batch_attention)

    def is_trimmable(self):
        return False

    def empty(self):
        return False


def batch_attention(queries, layer: BatchLayer, scale: float, sinks=None):
    """queries [T, Hq, 1, D] (one row per token) -> [T, Hq, 1, Dv], each row over its own sequence's pages."""
    if not layer.attend:
        return queries  # a stand-in of the right shape for the model code; nothing evaluates it
    out, decode, r = [], [], 0
    for caches, n in layer.plan.segments:
        cache = caches[layer.layer]
        w = 1 if layer.plan.sampled_only else n  # a prompt chunk's last row sees its whole chunk: no mask
        if n == 1 and cache.window is None and sinks is None and not cache.dense:
            decode.append((len(out), r, cache))
            out.append(None)
        else:
            q = queries[r : r + w, :, 0].transpose(1, 0, 2)[None]
            o = paged_attention(q, cache, scale, "causal" if w > 1 else None, sinks)
            out.append(o[0].transpose(1, 0, 2)[:, :, None])
        r += w
    if decode:
        plan, every = layer.plan, len(decode) == len(out)  # every: a decode-only step, rows in order
        q = queries[:, :, 0] if every else queries[mx.array([r for _, r, _ in decode]), :, 0]
        caches = [c for _, _, c in decode]
        o = kernel_attention_batch(q, caches, scale)  # x86-64 CPUs: sealed 4-bit pages read in place
        if o is None:
            o = _decode_batch(q, caches, scale, plan.memo, plan.masks, plan.dequant)
        else:
            _drop_layer(plan.memo, layer.layer)
        for c in caches:
            c.settle_window()  # a page this token sealed was read from its float copy: the copy goes now
        if every:  # no gather of the rows' queries, no split and concatenation of their outputs
            return o[:, :, None].astype(queries.dtype)
        for j, (slot, _, _) in enumerate(decode):
            out[slot] = o[j][:, None][None]
    o = out[0] if len(out) == 1 else mx.concatenate(out, axis=0)
    return o.astype(queries.dtype)


GROUPS = (FULL, QUANT, OPEN)  # sealed float, sealed quantized, the page being filled
OPEN_STEP = 32  # open pages are read in whole steps of this many slots (few distinct shapes, little waste)
DEQUANT_TOKENS = 4096  # most sealed 4-bit tokens (all rows of a batch) a memo keeps dequantized to float32, per
# layer, where the CPU kernel does not serve the batch (another CPU or format, a row with no 4-bit page): MLX's
# CPU quantized_matmul scores and mixes them several times slower than BLAS reads their float copy; default model: 46 KB a token over all layers, 188 MB at the cap


def _split_pages(cache: PagedKVCache):
    """A decode query sees every key of its sequence, in any order: its pages of each kind in GROUPS. A float
    window copy (cache.py) joins the open pages: it changes as often, so it is stacked every step, never kept
    in the memo (kept there, each sequence's copies were stacked again, widened, every time one changed)."""
    out = {g: [] for g in GROUPS}
    for (_, n, page), (_, _, read) in zip(cache.pages(), cache.attended_pages()):
        out[OPEN if read is not page else page.kind].append((n, read))
    return [out[g] for g in GROUPS]


def _decode_batch(q, caches: Seq[PagedKVCache], scale: float, memo: Optional[dict] = None,
                  masks: Optional[dict] = None, dequant: bool = True):
    """One query per sequence, q [B, Hq, D] -> [B, Hq, Dv]: pages of each kind stacked per key run (short
    sequences padded and masked), scored on their stored format, merged with a softmax over all runs when
    their scores fit one small block, else an online softmax run by run; a long batch's runs are split
    across parallel CPU streams (streams.py). Sealed pages never change, so with a `memo` their stacks are
    reused while the batch's sealed pages stay the same (only the open pages are stacked every step), their
    4-bit pages dequantized when `dequant` and they fit DEQUANT_TOKENS; `masks` keeps the open pages' masks
    for the step's other layers."""
    B, Hq, D = q.shape
    c0 = caches[0]
    H, P = c0.n_kv_heads, c0.seq.page_size
    qf = (q.astype(mx.float32) * scale).reshape(B * H, Hq // H, D)
    n_parts = streams.parts(B * Hq * max(c.offset for c in caches))
    run_pages = max(1, RUN_ELEMENTS // (B * Hq * P))
    if n_parts > 1:  # runs short enough that every part gets some
        run_pages = min(run_pages, -(-max(c.seq.pages_for(c.offset) for c in caches) // n_parts))
    runs = list(_key_runs(caches, memo, run_pages, {} if masks is None else masks, dequant))
    prepared, shape = {}, (B * H, Hq // H, c0.value_dim)

    def scores(ck, kparts, valid):
        if id(ck) not in prepared:
            prepared[id(ck)] = ck.prepare(qf)
        s = ck.scores(prepared[id(ck)], kparts).astype(mx.float32)  # [B*H, rep, T]: whole pages, whole groups
        return s if valid is None else mx.where(valid, s, -float("inf"))

    def state(part):
        if fits_one_softmax(B * Hq * sum(r[-1] for r in part)):
            return softmax.whole([scores(ck, k, ok) for ck, _, k, _, ok, _ in part], [(r[1], r[3]) for r in part])
        fold = softmax.Online(mx.full((B * H, Hq // H, 1), -float("inf")), mx.zeros((B * H, Hq // H, 1)))
        for ck, cv, kparts, vparts, valid, _ in part:
            fold.fold(scores(ck, kparts, valid), cv, vparts)
        return fold

    if n_parts == 1 and fits_one_softmax(B * Hq * sum(r[-1] for r in runs)):
        return _one_softmax([scores(ck, k, ok) for ck, _, k, _, ok, _ in runs], runs).reshape(B, Hq, -1)
    parts = streams.balanced(runs, [r[-1] for r in runs], n_parts)
    return streams.merged(parts, lambda _, part: state(part)).result(shape).reshape(B, Hq, -1)


def _one_softmax(scores, runs):
    """sum_j softmax(scores)_j v_j over all runs in one mx.softmax, on fewer ops than softmax.whole (no -inf
    guards: every row sees at least its own new key)."""
    p = mx.softmax(scores[0] if len(scores) == 1 else mx.concatenate(scores, axis=-1), axis=-1, precise=True)
    o, t0 = None, 0
    for s, (_, cv, _, vparts, _, _) in zip(scores, runs):
        T = s.shape[-1]
        x = cv.finish(cv.mix(p if len(scores) == 1 else p[..., t0 : t0 + T], vparts))
        o, t0 = x if o is None else o + x, t0 + T
    return o


def _key_runs(caches, memo: Optional[dict], run_pages: int, masks: dict, dequant: bool):
    """(key codec, value codec, stacked key parts, stacked value parts, valid [B*H, 1, T] or None when every
    key is valid, T) per run of at most run_pages pages of one kind; sealed kinds come from `memo` when one
    is given, 4-bit ones dequantized (read by the float codecs) when `dequant` and they fit DEQUANT_TOKENS."""
    c0, P = caches[0], caches[0].seq.page_size
    split = [_split_pages(c) for c in caches]
    dequant = dequant and sum(n for s in split for n, _ in s[GROUPS.index(QUANT)]) <= DEQUANT_TOKENS
    used = set()  # this layer's memo slots read this step (the others are stale: dropped at the end)
    for g, kind in enumerate(GROUPS):
        lists = [s[g] for s in split]
        most = max(len(x) for x in lists)
        ck, cv = c0.codecs if kind == QUANT else c0.full
        common = _common(lists, P) if memo is not None and kind != OPEN else 0  # pages every row shares
        for p0, p1 in _bounds(0, common, run_pages) + _bounds(common, most, run_pages):
            if kind == OPEN and p1 == 1 and _whole_open(lists, P):
                yield (ck, cv, *_open_run(lists, P, masks))
            elif memo is None or kind == OPEN:
                yield (ck, cv, *_stack_run(lists, p0, p1, P, (ck, cv)), (p1 - p0) * P)
            else:
                floats, shared, slot = dequant and kind == QUANT, p1 <= common, (c0.layer, kind, p0)
                codecs = c0.full if floats else (ck, cv)
                if shared:  # one copy, scored once for every row
                    codecs = tuple(Shared(c, len(lists)) for c in codecs)
                used.add(slot)
                run = _memo_run(memo, slot, lists[:1] if shared else lists, p0, p1, P, (ck, cv), floats)
                yield (*codecs, *run, (p1 - p0) * P)
    for slot in [s for s in memo or {} if s[0] == c0.layer and s not in used]:
        del memo[slot]  # a run laid out differently now (the batch or its shared prefix changed)


def _drop_layer(memo: Optional[dict], layer: int):
    """Free a layer's stacked runs (the CPU kernel reads its pages in place now)."""
    for slot in [s for s in memo or {} if s[0] == layer]:
        del memo[slot]


def memo_nbytes(memo: Optional[dict]) -> int:
    """Bytes of the stacked page copies a decode memo holds (a budget counts them with the pages)."""
    if not memo:
        return 0
    return sum(a.nbytes for _, _, (k, v, _) in memo.values() for a in (*k, *v))


def _common(lists, P: int) -> int:
    """How many leading pages every row of a batch of several holds in common (the same whole pages: a
    shared prefix's)."""
    if len(lists) < 2:
        return 0
    n = 0
    for column in zip(*lists):
        if any(c[1] is not column[0][1] or c[0] != P for c in column):
            break
        n += 1
    return n


def _bounds(start: int, stop: int, step: int) -> list:
    """[(p0, p1)] runs of at most `step` pages covering start..stop."""
    return [(p0, min(stop, p0 + step)) for p0 in range(start, stop, step)]


class Shared:
    """A codec reading one copy of pages every row of the batch shares: the B rows' queries of a kv head are
    scored as one [B*rep, D] block against it ([H, B*rep, D] @ [H, D, T]), not against B stacked copies
    (c=4: a 256-token float32 prefix page is 11.8 MB over the default model's layers, not 47 MB)."""

    def __init__(self, codec, rows: int):
        self.codec, self.rows = codec, rows

    def _heads_first(self, x):
        """[B*H, r, n] -> [H, B*r, n]."""
        BH, r, n = x.shape
        return x.reshape(self.rows, BH // self.rows, r, n).swapaxes(0, 1).reshape(BH // self.rows, self.rows * r, n)

    def _rows_first(self, x):
        """[H, B*r, n] -> [B*H, r, n]."""
        H, Br, n = x.shape
        return x.reshape(H, self.rows, Br // self.rows, n).swapaxes(0, 1).reshape(self.rows * H, Br // self.rows, n)

    def prepare(self, q):
        return self.codec.prepare(self._heads_first(q))

    def scores(self, qc, parts):
        return self._rows_first(self.codec.scores(qc, parts))

    def mix(self, p, parts):
        return self._rows_first(self.codec.mix(self._heads_first(p), parts))

    def finish(self, o):
        return self.codec.finish(o)


def drop_decoded(memo: Optional[dict]):
    """Free a memo's dequantized runs (a budget that holds stored-format copies but not float32 ones)."""
    for slot in [slot for slot, (key, _, _) in (memo or {}).items() if key[0]]:
        del memo[slot]


def _memo_run(memo: dict, slot: tuple, lists, p0: int, p1: int, P: int, codecs, decoded: bool = False):
    """_stack_run of sealed pages with their 16-bit floats widened to float32 (what every read would cast
    them to), or `decoded` to float32 keys and values (read as float pages), reused from `memo` while every
    row's pages in the run are the same objects (the entry holds them, so their ids cannot be reused
    meanwhile); one entry per slot."""
    key = (decoded, tuple(tuple((n, id(page)) for n, page in x[p0:p1]) for x in lists))
    hit = memo.get(slot)
    if hit is not None and hit[0] == key:
        return hit[2]
    k, v, valid = _stack_run(lists, p0, p1, P, codecs)
    if decoded:  # (zero padding decodes to zeros, masked like any padding)
        run = (codecs[0].decode(k),), (codecs[1].decode(v),), valid
    else:
        run = codecs[0].widened(k, mx.float32), codecs[1].widened(v, mx.float32), valid  # cast once, not every step
    memo[slot] = (key, [x[p0:p1] for x in lists], run)
    return run


def _stack_run(lists, p0: int, p1: int, P: int, codecs):
    """Pages p0..p1 of each sequence's list (partial pages cut by their codec), zero-padded to one length
    and stacked [B*H, T, ...]; `valid` [B*H, 1, T] masks the padding (None: no padding). Only a row's own
    pages are read."""
    T = (p1 - p0) * P
    template = next(x[p0][1].parts() for x in lists if len(x) > p0)
    ks, vs, counts = [], [], []
    for pages in lists:
        run = pages[p0:p1]
        counts.append(sum(n for n, _ in run))
        for w, out in ((0, ks), (1, vs)):
            codec = codecs[w]
            parts = [codec.take(page.parts()[w], n) if n < P else page.parts()[w] for n, page in run]
            out.append(_cat(parts, template[w], codec.width(counts[-1]), codec.width(T)))
    H = template[0][0].shape[0]
    kparts = tuple(mx.stack(col).reshape(-1, *col[0].shape[1:]) for col in zip(*ks))
    vparts = tuple(mx.stack(col).reshape(-1, *col[0].shape[1:]) for col in zip(*vs))
    if all(c == T for c in counts):  # every row's run is whole: nothing to mask
        return kparts, vparts, None
    return kparts, vparts, _valid(counts, H, T)


def _valid(counts, H: int, T: int):
    """[B*H, 1, T]: True at each row's first counts[b] keys (past them: padding, or undefined slots)."""
    valid = mx.arange(T)[None] < mx.array(counts)[:, None]
    return mx.broadcast_to(valid[:, None, None, :], (len(counts), H, 1, T)).reshape(len(counts) * H, 1, T)


def _whole_open(lists, P: int) -> bool:
    """True when every sequence reads exactly one open page, a whole [H, P, D] buffer (batched sequences: no
    float-window copies beside it)."""
    return all(len(x) == 1 and x[0][1].kind == OPEN and x[0][1].parts()[0][0].shape[1] == P for x in lists)


def _open_run(lists, P: int, masks: dict):
    """The sequences' open pages stacked, [B*H, T, D], cut at the longest count rounded up to OPEN_STEP slots
    (the stack, cast and scores grow with the tokens written, not the page size), with slots past each
    page's count masked out of the scores and zeroed in the values (they are undefined); the masks are built
    once a step (`masks`: every layer's open pages hold the same counts). Returns (keys, values, valid, T)."""
    counts = tuple(x[0][0] for x in lists)
    T = min(P, -(-max(counts) // OPEN_STEP) * OPEN_STEP)
    k = mx.concatenate([x[0][1].parts()[0][0][:, :T] for x in lists])  # [B*H, T, D]
    v = mx.concatenate([x[0][1].parts()[1][0][:, :T] for x in lists])
    H = k.shape[0] // len(lists)
    if (counts, H, T) not in masks:
        valid = _valid(counts, H, T)
        masks[counts, H, T] = valid, valid.swapaxes(-1, -2)
    valid, rows = masks[counts, H, T]
    return (k,), (mx.where(rows, v, 0),), valid, T


def _cat(parts_list, template, n: int, T: int):
    """One sequence's page parts concatenated along tokens and zero-padded from n to T storage units."""
    if not parts_list:
        return tuple(mx.zeros((z.shape[0], T, *z.shape[2:]), z.dtype) for z in template)
    cols = concat_parts(parts_list)
    if n == T:
        return cols
    return tuple(mx.pad(c, [(0, 0), (0, T - n)] + [(0, 0)] * (c.ndim - 2)) for c in cols)
