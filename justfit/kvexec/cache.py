"""PagedKVCache: one layer's view of a paged sequence, implementing mlx-lm's cache protocol.

`update_and_fetch` writes new K/V into the sequence's pages (the page being filled stays full precision
and is quantized when it seals) and returns lightweight `PagedKV` handles. The float window: a quantized
page keeps a float copy beside it while it is among the `kv.float_pages` pages before the first new
token's own, so every query reads its own page and the previous one in full precision whatever the chunking
(`attended_pages`); the copy is this sequence's, in memory only. Batched serving (`for_batch`) keeps no
window but still copies a page sealed within a chunk until that chunk's attention has read it, so every
query reads its own page in 16 bits and older pages as stored: what it reads never depends on how the
prompt was chunked (the engine sizes chunks by load). The attention dispatcher
installed by routing.py recognizes them and runs paged attention (attention.py). For a model whose
attention cannot be routed, the cache runs in `dense` mode and returns dequantized K/V arrays instead.
"""

from typing import Optional

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from ..errors import UserError
from . import kernels
from .decode import RunMemo
from .formats import full_codecs, make_codecs, storage_dtype
from .pages import FULL, OPEN, QUANT, Page, Sequence


class PagedKV:
    """Handle standing for one layer's keys or values; `shape` mimics the array mlx-lm would get."""

    def __init__(self, cache: "PagedKVCache", which: str):
        self.cache, self.which = cache, which

    @property
    def shape(self):
        dim = self.cache.head_dim if self.which == "k" else self.cache.value_dim
        return (1, self.cache.n_kv_heads, self.cache.offset, dim)

    @property
    def dtype(self):
        return self.cache.dtype


class PagedMask:
    """Mask handle: causal, optionally restricted to a sliding window of `window` keys (self included)."""

    def __init__(self, window: Optional[int] = None):
        self.window = window


class PagedKVCache(_BaseCache):
    """mlx-lm cache protocol over one layer of a `Sequence` (see pages.py)."""

    def __init__(self, seq: Sequence, layer: int, kv, window: Optional[int] = None, dense: bool = False):
        self.seq, self.layer, self.kv = seq, layer, kv
        self.window, self.dense = window, dense
        self.poison = False  # tests: fill fresh page buffers with NaN to prove they are never read
        self.codecs = self.full = None
        self.n_kv_heads = self.head_dim = self.value_dim = self.dtype = None
        self.open_dtype = None  # open pages' dtype: K/V's own, or the 16-bit storage dtype when batched (_setup)
        self.batched = False  # batched serving (for_batch): capacity over one sequence's per-token speed
        self.recent = {}  # page index -> float Page of a quantized page in the float window
        self.windowed = kv.float_pages > 0  # whether sealing pages get float copies (drop_window(keep=False))
        self.memo = RunMemo()  # a short context's sealed pages stacked for decode (decode.py)

    # ---- protocol -------------------------------------------------------------------------------
    @property
    def offset(self) -> int:
        return self.seq.lengths[self.layer]

    def update_and_fetch(self, keys, values):
        B, H, L, D = keys.shape
        if B != 1:
            raise UserError("KVExec paged caches hold one sequence (batch size 1)")
        self.append(keys.reshape(H, L, D), values.reshape(H, L, values.shape[-1]))
        if self.dense:
            return self.dense_kv()
        return PagedKV(self, "k"), PagedKV(self, "v")

    def append(self, keys, values):
        """Write L new tokens' keys and values [H, L, D] into this layer's pages (update_and_fetch without its
        handles: batched decode hands each row over split out of the step's K/V, with no op of its own)."""
        H, L, D = keys.shape
        if self.codecs is None:
            self._setup(H, D, values.shape[-1], keys.dtype)
        start = self.offset
        self.seq.reserve(start + L)  # atomic across layers: raises before anything changes
        self._forget(start // self.seq.page_size - self.window_pages)
        pos, P = start, self.seq.page_size
        while pos < start + L:
            index, off = divmod(pos, P)
            n = min(P - off, start + L - pos)
            if n == L:  # one page takes the whole input (a decode token): no slice
                self._write(index, off, keys, values)
            else:
                self._write(index, off, keys[:, pos - start : pos - start + n], values[:, pos - start : pos - start + n])
            pos += n
        self.seq.lengths[self.layer] = start + L

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        window = window_size or self.window
        if self.dense or return_array:
            return create_attention_mask(N, self.offset, return_array, window)
        if window is not None:
            return PagedMask(window)
        return "causal" if N > 1 else None

    def is_trimmable(self):
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        P = self.seq.page_size
        if self.offset - n < self.offset // P * P:
            self.drop_memo()  # a sealed page is cut: free a stale stack now, not at the next decode
        self.seq.set_length(self.layer, self.offset - n)
        return n

    def size(self):
        return self.offset

    def empty(self):
        return self.offset == 0

    @property
    def state(self):
        """All arrays of this layer's live pages (what mx.eval must materialize after a prefill chunk)."""
        arrays = []
        for page in [p for _, _, p in self.pages()] + list(self.recent.values()):
            k, v = page.parts()
            arrays.extend(k)
            arrays.extend(v)
        return arrays

    @state.setter
    def state(self, v):
        raise UserError("PagedKVCache state cannot be set directly; restore pages with Sequence.append_restored")

    @property
    def meta_state(self):
        return (self.kv.name, str(self.kv.group_size), str(self.seq.page_size), str(self.offset))

    @property
    def nbytes(self) -> int:
        """Bytes of this layer's pages plus their float-window copies and the decode memo's stacked pages."""
        return sum(page.nbytes for _, _, page in self.pages()) + self.window_nbytes + self.memo.nbytes

    @property
    def window_nbytes(self) -> int:
        """Bytes of the float-window copies (held by this cache, outside the page pool)."""
        return sum(page.nbytes for page in self.recent.values())

    # ---- pages ----------------------------------------------------------------------------------
    def pages(self):
        """[(first token position, valid tokens, Page)] for this layer's pages in token order."""
        P, out = self.seq.page_size, []
        for index in range(self.seq.pages_for(self.offset)):
            page = self.seq.pool.get(self.layer, self.seq.table[index])
            out.append((index * P, min(P, self.offset - index * P), page))
        return out

    def attended_pages(self, query: Optional[int] = None):
        """pages() as the query at position `query` (default: the newest token) reads them: a quantized page in
        the float window as its float copy; when batched, only that query's own page (see for_batch)."""
        if not self.recent:
            return self.pages()
        P = self.seq.page_size
        own = (self.offset - 1 if query is None else query) // P
        return [(s, n, self.recent.get(s // P, page) if page.kind == QUANT and (not self.batched or s // P == own)
                 else page) for s, n, page in self.pages()]

    def codec(self, page: Page):
        """(key codec, value codec) that read this page."""
        return self.codecs if page.kind == QUANT else self.full

    def dense_kv(self):
        """All keys and values dequantized, [1, H, offset, D] (dense mode and tests only)."""
        ks, vs = [], []
        for _, n, page in self.attended_pages():
            (ck, cv), (k, v) = self.codec(page), page.parts()
            ks.append(ck.decode(k)[:, :n].astype(self.dtype))
            vs.append(cv.decode(v)[:, :n].astype(self.dtype))
        return mx.concatenate(ks, axis=1)[None], mx.concatenate(vs, axis=1)[None]

    def _setup(self, H, D, Dv, dtype):
        if self.kv.bits != 16 and D != Dv:
            raise UserError(f"quantized KV pages need equal key and value head dims, got {D} and {Dv}")
        self.n_kv_heads, self.head_dim, self.value_dim, self.dtype = H, D, Dv, dtype
        self.open_dtype = storage_dtype(self.kv, dtype) if self.batched else dtype
        self.codecs = make_codecs(self.kv, D, dtype)
        self.full = full_codecs(self.kv, D, Dv, dtype)

    def adopt_window(self, parent: "PagedKVCache"):
        """Share a parent's float copies (a fork holds the same pages, so the same tokens)."""
        self.recent.update(parent.recent)

    def settle_window(self):
        """After a chunk's attention: keep only the copies later queries read (the `float_pages` before the
        next token's page), so a long prefill chunk, whose queries needed all of its pages' copies, leaves
        at most float_pages of them."""
        self._forget(self.offset // self.seq.page_size - self.window_pages)

    @property
    def window_pages(self) -> int:
        """Sealed pages before the first new token's own that keep their float copies: none when batched."""
        return 0 if self.batched else self.kv.float_pages

    def drop_window(self, keep: bool = True):
        """Free the float copies now: attention reads those pages quantized; pages sealed later get copies
        again unless keep is False (the batch scheduler's sequences run without them)."""
        self.recent.clear()
        self.windowed = self.windowed and keep

    def for_batch(self):
        """Batched serving (the scheduler): no float window, and open pages in the 16-bit storage dtype, so a
        sequence holds what engine/kvbytes.KVBytes counts (a float32 open page is ~6 MB more a sequence on
        the default model: 12 instead of 14 4k-token sequences in 512 MiB). A page sealed within a chunk keeps
        its copy only while that chunk's attention runs (window_pages). Mid-sequence too: the copies and
        the memo that stacked them go now, and the open page is cast once at its next write."""
        self.drop_window(keep=False)
        self.drop_memo()
        self.batched = True
        if self.dtype is not None:
            self.open_dtype = storage_dtype(self.kv, self.dtype)

    def drop_memo(self):
        """Free the decode memo's stacked copies of sealed pages (decode.py rebuilds them from the pages when
        it next runs): after a trim that cuts a sealed page, or when the pages leave memory (a KV spill)."""
        self.memo.clear()

    def _forget(self, first: int):
        """Drop the float copies of pages before index `first` (they left the float window)."""
        for index in [i for i in self.recent if i < first]:
            del self.recent[index]

    def _write(self, index: int, off: int, k, v):
        pid = self.seq.writable(index)  # copy-on-write when another sequence shares the page
        P = self.seq.page_size
        copy = self.recent.pop(index, None)  # the page is rewritten: its float copy, if any, is stale after this
        if off == 0 and k.shape[1] == P:
            return self._seal(pid, index, k, v)
        page = self.seq.pool.get(self.layer, pid)
        if page is None or off == 0:
            kb, vb = self._fresh(k.shape[0], P, self.head_dim), self._fresh(k.shape[0], P, self.value_dim)
        else:
            kb, vb = self._unsealed(page if copy is None else copy)
        at = mx.array([0, off, 0])
        kb = mx.slice_update(kb, k.astype(kb.dtype), at, axes=(0, 1, 2))
        vb = mx.slice_update(vb, v.astype(vb.dtype), at, axes=(0, 1, 2))
        if off + k.shape[1] == P:
            return self._seal(pid, index, kb, vb)
        self.seq.pool.put(self.layer, pid, Page(OPEN, (kb,), (vb,)))

    def _fresh(self, H, P, D):
        """An open page's buffer, in the dtype K/V arrive in: a token written and read every step is never cast
        (4 fewer ops a layer per decode step than a 16-bit buffer: ~3% of decode on the default model, CPU);
        sealing stores it in the storage dtype. Batched sequences keep it in 16 bits (for_batch)."""
        fill = float("nan") if self.poison else 0.0
        return mx.full((H, P, D), fill, dtype=self.open_dtype)

    def _unsealed(self, page: Page):
        """Full-precision buffers of a page about to be written (a sealed page reopened by a trim)."""
        (ck, cv), (k, v) = self.codec(page), page.parts()
        if page.kind == OPEN:  # (one restored or attached from a cache of the other mode: cast once, here)
            return k[0].astype(self.open_dtype), v[0].astype(self.open_dtype)
        return ck.decode(k).astype(self.open_dtype), cv.decode(v).astype(self.open_dtype)

    def _seal(self, pid: int, index: int, k, v):
        """A full page: keep it full precision (bits=16 or inside quantized_kv_start), else quantize it."""
        if self.kv.bits == 16 or index * self.seq.page_size < self.kv.quantized_kv_start:
            fk, fv = self.full
            page = Page(FULL, fk.encode(k), fv.encode(v))
        else:
            ck, cv = self.codecs
            if self.batched:  # coded from what its open page held, however the page's tokens arrived (chunking)
                k, v = k.astype(self.open_dtype), v.astype(self.open_dtype)
            k, v = k.astype(self.dtype), v.astype(self.dtype)  # a 16-bit open page (batched): code from float32
            page = Page(QUANT, kernels.seal(ck, k) or ck.encode(k), kernels.seal(cv, v) or cv.encode(v))
            if self.windowed or self.batched:  # batched: only until this chunk's attention read it (settle_window)
                fk, fv = self.full
                self.recent[index] = Page(FULL, fk.encode(k), fv.encode(v))
        self.seq.pool.put(self.layer, pid, page)


def causal_mask_array(L: int, offset: int, window: Optional[int]):
    """The dense mask mlx-lm would build, for reference attention in tests."""
    return create_causal_mask(L, offset - L, window_size=window)
