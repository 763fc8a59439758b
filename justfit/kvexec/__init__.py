"""KVExec: paged KV cache (fp16 / affine 4-8 bit / rotated 4-bit) with bounded-workspace attention.

Entry point: `make_cache(model, kv)` -> per-layer caches for any mlx-lm model object, usable as
`mlx_lm.generate(model, tokenizer, prompt, prompt_cache=caches)`. The caches of one call share a
`Sequence` (block table) over a `PagePool` (pages.py documents the sharing / checkpoint / restore API
for StateTrans); `fork_caches(caches)` gives a copy-on-write child. Page layouts: FORMAT.md.
"""

from typing import List, Optional

from ..config import KVConfig
from .cache import PagedKV, PagedKVCache, PagedMask
from .decode import kernel_serves
from .pages import Page, PagePool, Sequence
from .routing import route

__all__ = ["make_cache", "fork_caches", "sequence_of", "kernel_serves", "PagedKVCache", "PagedKV", "PagedMask", "Page", "PagePool", "Sequence", "KVConfig"]


def make_cache(model, kv: Optional[KVConfig] = None, pool: Optional[PagePool] = None) -> List:
    """Per-layer KVExec caches for an mlx-lm model: KVCache layers become paged, sliding-window
    (RotatingKVCache) layers become paged with that window, other caches (SSM state...) stay as they are."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    kv = kv or KVConfig()
    base = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.layers]
    dense = not route(model)  # attention we cannot route still works, on dequantized K/V
    pool = pool or PagePool(len(base), kv.page_size)
    if pool.n_layers != len(base) or pool.page_size != kv.page_size:
        raise ValueError("page pool does not match this model's layers or the KV page size")
    seq = Sequence(pool)
    out = []
    for i, c in enumerate(base):
        if type(c) is KVCache:
            out.append(PagedKVCache(seq, i, kv, dense=dense))
        elif type(c) is RotatingKVCache:
            out.append(PagedKVCache(seq, i, kv, window=c.max_size, dense=dense))
        else:
            out.append(c)
    return out


def sequence_of(caches) -> Sequence:
    """The Sequence (block table) shared by a make_cache() list."""
    return next(c.seq for c in caches if isinstance(c, PagedKVCache))


def fork_caches(caches) -> List:
    """Caches for a child sequence sharing every page of `caches` (copy-on-write on the partial page)."""
    child = sequence_of(caches).fork()
    out = []
    for c in caches:
        if isinstance(c, PagedKVCache):
            f = PagedKVCache(child, c.layer, c.kv, window=c.window, dense=c.dense)
            if c.codecs is not None:
                f._setup(c.n_kv_heads, c.head_dim, c.value_dim, c.dtype)
            f.adopt_window(c)
            out.append(f)
        else:
            raise ValueError("only fully paged cache lists can be forked")
    return out
