"""Dispatch from KVExec to the Metal kernels (`metal_kernels/`), or to KVExec's own MLX-ops path.

`backend()` is "metal" when `mx.metal.is_available()`, else "reference"; JUSTFIT_KERNELS=metal|
reference|emulator forces one ("emulator" runs the same kernels' MSL through the CPU emulator, for
tests). On "reference" nothing here runs and KVExec is unchanged. On a kernel backend, decode (1
query) and verify (2-8 queries) gather the layer's quantized pages into the kernels' pool layout
(affine, rotated, or channel keys with affine values) and sealing calls the seal kernels; every call
the kernels cannot serve exactly as KVExec would (sliding window, dense mask, sinks, prefill,
unsupported head dim...) returns None, and KVExec's MLX-ops path runs it. Both paths take and
return the same arrays.
"""

from collections import Counter

import mlx.core as mx

from ..errors import UserError
from .pages import QUANT

KERNEL_DIMS = (64, 128, 256)  # head dims (after KVExec's padding) the kernels are built and tested for
MAX_QUERIES = 8  # verify takes 2..8 queries; longer blocks are prefill
CALLS = Counter()  # "attention", "seal", "fallback": what ran, for tests and benchmarks


def backend() -> str:
    """The kernel backend for this process: metal | reference | emulator (see module doc)."""
    import metal_kernels

    try:
        return metal_kernels.backend()
    except (ValueError, RuntimeError) as e:  # a bad JUSTFIT_KERNELS is the user's to fix
        raise UserError(str(e)) from None


def _kernel_backend():
    """The backend when it runs kernels, else None (reference: KVExec's MLX-ops path)."""
    b = backend()
    return None if b == "reference" else b


def _supported(ck, cv) -> bool:
    """True when (key codec, value codec) has a kernel: 4-bit, one padded dim in 64/128/256, and
    either one format for both (affine or rotated) or channel keys with affine values."""
    if cv.name == "affine":
        pair = cv.bits == 4 and ck.name in ("affine", "channel") and ck.bits == 4
    else:
        pair = ck.name == cv.name == "rotated"
    return pair and ck.dim == cv.dim and ck.dim in KERNEL_DIMS


def _pad(x, d):
    extra = d - x.shape[-1]
    return x if extra == 0 else mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


# ---- sealing ------------------------------------------------------------------------------------
def seal(codec, x):
    """Encode a full page [H, P, D] with the seal kernel, or None to let `codec.encode` do it.

    Channel keys have no seal kernel: ChannelCodec.encode (MLX ops) seals them on every backend."""
    b = _kernel_backend()
    if b is None or codec.name not in ("affine", "rotated") or codec.dim not in KERNEL_DIMS:
        return None
    import metal_kernels as mk

    if codec.name == "affine" and codec.bits not in (4, 8):
        return None
    CALLS["seal"] += 1
    if codec.name == "affine":
        return codec.stored(mk.seal_affine(_pad(x, codec.dim), group_size=codec.group_size, bits=codec.bits,
                                           backend=b))
    codes, norms = mk.seal_rotated(_pad(x.astype(mx.float32), codec.dim), codec.signs, codec.codebook,
                                   backend=b)
    return codes, norms


# ---- attention ----------------------------------------------------------------------------------
def attention(queries, cache, scale, mask, sinks):
    """Decode / verify attention of queries [1, Hq, L, D] on the kernels, or None to fall back.

    Quantized pages become the kernels' pool ([n, H, P, ...] stacked in sequence order, page_table
    0..n-1); every full-precision token (sealed `fp` pages such as the first page under
    quantized_kv_start, and the open page) becomes the recent window [H, R, D] in sequence order.
    Attention is order-free except for the causal mask among the queries, so this is exact as long
    as the L queries are the last L tokens of that window.
    """
    b = _kernel_backend()
    if b is None:
        return None
    _, hq, L, _ = queries.shape
    if not _plain(cache, L, hq, mask, sinks):
        CALLS["fallback"] += 1
        return None
    split = _split(cache, L)
    if split is None:
        CALLS["fallback"] += 1
        return None
    quant, q_len, floats = split
    ck, cv = cache.codecs
    import metal_kernels as mk

    d, dim = cache.head_dim, ck.dim
    k_pages = _pool([p.parts()[0] for p in quant])
    v_pages = _pool([p.parts()[1] for p in quant])
    table = mx.arange(len(quant), dtype=mx.int32)
    k_recent, v_recent = (_recent(floats, which, cache, dim) for which in (0, 1))
    kw = dict(scale=scale, rotation=None, group_size=getattr(cv, "group_size", 64), bits=4, backend=b)
    if ck.name == "rotated":
        kw["rotation"] = (ck.codebook, ck.signs, cv.signs)
    elif ck.name == "channel":  # values keep their own group; keys are grouped along tokens
        kw.update(key_format="channel", key_group=ck.group_size)
    q = _pad(queries[0], dim)
    fn = mk.decode_attention if L == 1 else mk.verify_attention
    o = fn(q, k_pages, v_pages, table, q_len, k_recent, v_recent, **kw)
    CALLS["attention"] += 1
    return o[None, :, :, :d].astype(queries.dtype)


def _plain(cache, L, hq, mask, sinks) -> bool:
    """Only plain causal decode/verify over quantized 4-bit pages with a kernel head dim."""
    if sinks is not None or cache.window is not None or cache.codecs is None:
        return False
    if mask is not None and not (isinstance(mask, str) and mask == "causal"):
        return False  # PagedMask (sliding window) or a dense array mask
    if not _supported(*cache.codecs) or cache.value_dim != cache.head_dim:
        return False
    H = cache.n_kv_heads
    return 1 <= L <= MAX_QUERIES and hq % H == 0 and hq // H <= 32


def _split(cache, L):
    """(quantized Page list, valid tokens in them, [(tokens, Page)] full-precision) or None.

    None when the kernels would not be exact: no quantized page, a partial quantized page that is
    not the last one, or one of the L queries' own tokens stored in a quantized page (L > 1).
    """
    quant, floats, q_len = [], [], 0
    pages = cache.attended_pages()
    for _, n, page in pages:
        if page.kind == QUANT:
            if quant and q_len != len(quant) * cache.seq.page_size:
                return None  # a partial quantized page followed by another one
            quant.append(page)
            q_len += n
        else:
            floats.append((n, page))
    if not quant:
        return None
    if L > 1:  # the last L tokens must all sit in full-precision pages
        tail = 0
        for _, n, page in reversed(pages):
            if page.kind == QUANT:
                break
            tail += n
        if tail < L:
            return None
    return quant, q_len, floats


def _pool(parts):
    """Per-page parts (each [H, P, ...]) stacked into pools [n, H, P, ...]."""
    return tuple(mx.stack(col) if len(col) > 1 else col[0][None] for col in zip(*parts))


def _recent(floats, which, cache, dim):
    """The full-precision tokens (keys or values) in sequence order, [H, R, dim] (R may be 0)."""
    xs = [page.parts()[which][0][:, :n] for n, page in floats]
    if not xs:
        return mx.zeros((cache.n_kv_heads, 0, dim), cache.dtype)
    x = xs[0] if len(xs) == 1 else mx.concatenate(xs, axis=1)
    return _pad(x.astype(cache.dtype), dim)  # pages may store 16-bit floats; the kernels take the compute dtype
