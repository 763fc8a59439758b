"""Dispatch: the operations KVExec calls, on Metal kernels or on the MLX-ops reference.

Both paths take and return the same arrays. The backend is `backend()` (Metal when available,
JUSTFIT_KERNELS=metal|reference|emulator forces one) unless a call passes backend=...

Page arguments (the KV page contract, batch 1, one layer):
  affine pages:  (codes uint32 [N, H, P, D*bits/32], scales [N, H, P, D/g], biases [N, H, P, D/g])
  rotated pages: (codes uint32 [N, H, P, D/8], norms float16 [N, H, P]), with
                 rotation = (codebook float [16], k_signs [D], v_signs [D])
  channel keys (key_format="channel", 4-bit, with affine values; decode/verify only):
                 (codes uint32 [N, H, P/kg, D, kg/8], scales, biases [N, H, P/kg, D, 1]),
                 kg = key_group tokens per channel group (KVExec's ChannelCodec)
  page_table int32 [n]: pool index of each page of the sequence, in order; q_len: valid tokens
  in those pages (the last page may be partial); k_recent, v_recent [H, R, D] (R may be 0): the
  full-precision tokens after the pages. Queries q [HQ, NQ, D] are the last NQ tokens.
"""

import mlx.core as mx

from . import reference
from ._common import backend as default_backend
from .attention_pass1 import attention_pass1
from .attention_pass2 import attention_pass2
from .dequant import dequant_pages
from .seal_affine import seal_affine as _seal_affine_kernel
from .seal_rotated import seal_rotated as _seal_rotated_kernel


def _pick(backend):
    return backend or default_backend()


def seal_affine(x, *, group_size=64, bits=4, backend=None):
    """A full page [H, P, D] to (codes, scales, biases), identical to mx.quantize."""
    b = _pick(backend)
    if b == "reference":
        return reference.seal_affine(x, group_size, bits)
    return _seal_affine_kernel(x, group_size=group_size, bits=bits, backend=b)


def seal_rotated(x, signs, codebook, *, backend=None):
    """A full page [H, P, D] to (codes uint32 [H, P, D/8], norms float16 [H, P])."""
    b = _pick(backend)
    if b == "reference":
        return reference.seal_rotated(x, signs, codebook)
    return _seal_rotated_kernel(x, signs, codebook, backend=b)


def _rotated_inputs(q, k_recent, v_recent, rotation):
    codebook, k_signs, v_signs = rotation
    return (reference.rotate(q, k_signs), reference.rotate(k_recent, k_signs),
            reference.rotate(v_recent, v_signs))


def _reference_kv(pages, page_table, q_len, recent, rotation, group_size, bits, channel=None):
    """Full K or V [H, q_len + R, D] float32 from pages and the recent window.

    channel: the token group of channel-quantized keys, None for the other formats."""
    if page_table.size == 0:
        return recent.astype(mx.float32)
    if channel is not None:
        x = reference.dequant_channel(*pages, page_table, channel, mx.float32)
    elif rotation is None:
        x = reference.dequant_affine(*pages, page_table, group_size, bits, mx.float32)
    else:
        x = reference.dequant_rotated(*pages, rotation[0], page_table, mx.float32)
    return mx.concatenate([x[:, :q_len], recent.astype(mx.float32)], axis=1)


def _padded(k_pages, v_pages, page_table, k_recent, v_recent):
    """Kernels need non-empty arrays: a dummy page / recent token when there is none."""
    h, r, d = k_recent.shape
    if r == 0:
        k_recent = v_recent = mx.zeros((h, 1, d), k_recent.dtype)
    if page_table.size == 0:
        page_table = mx.zeros((1,), mx.int32)
        k_pages, v_pages = (tuple(mx.zeros((1, *p.shape[1:]), p.dtype) for p in pages)
                            for pages in (k_pages, v_pages))
    return k_pages, v_pages, page_table, k_recent, v_recent


def _key_group(key_format, key_group, rotation, bits):
    """The channel keys' token group (None for affine / rotated keys), after checking the mix."""
    if key_format == "affine":
        return None
    if key_format != "channel" or rotation is not None or bits != 4 or not key_group:
        raise ValueError("key_format must be 'affine', or 'channel' with a key_group, "
                         f"4-bit affine values and no rotation, not {key_format!r}")
    return key_group


def paged_attention(q, k_pages, v_pages, page_table, q_len, k_recent, v_recent, *, scale,
                    group_size=64, bits=4, rotation=None, pages_per_split=4, key_format="affine",
                    key_group=None, backend=None):
    """Attention of q [HQ, NQ, D] (NQ 1..8) over pages + recent window; [HQ, NQ, D] in q.dtype.

    group_size / bits are the values' (and affine keys'); key_format="channel" reads channel keys
    in token groups of key_group."""
    b = _pick(backend)
    channel = _key_group(key_format, key_group, rotation, bits)
    dtype = q.dtype
    page_table = page_table.astype(mx.int32)
    r_len = k_recent.shape[1]
    if rotation is not None:
        q, k_recent, v_recent = _rotated_inputs(q, k_recent, v_recent, rotation)
    if b == "reference":
        k = _reference_kv(k_pages, page_table, q_len, k_recent, rotation, group_size, bits, channel)
        v = _reference_kv(v_pages, page_table, q_len, v_recent, rotation, group_size, bits)
        o = reference.attention(q, k, v, scale)
    else:
        page_size = v_pages[0].shape[2]  # values hold one row per token in every format
        k_pages, v_pages, table, k_recent, v_recent = _padded(
            k_pages, v_pages, page_table, k_recent, v_recent)
        lengths = mx.array([q_len, r_len], dtype=mx.int32)
        parts = attention_pass1(
            q, k_pages, v_pages, table, lengths, k_recent, v_recent, scale=scale,
            page_size=page_size, pages_per_split=pages_per_split, group_size=group_size,
            bits=bits, codebook=None if rotation is None else rotation[0], key_format=key_format,
            key_group=channel, backend=b)
        out_dtype = mx.float32 if rotation is not None else dtype
        o = attention_pass2(*parts, dtype=out_dtype, backend=b)
    if rotation is not None:
        o = reference.unrotate(o, rotation[2])
    return o.astype(dtype)


def decode_attention(q, k_pages, v_pages, page_table, q_len, k_recent, v_recent, **kw):
    """One decode query per head: q [HQ, 1, D]; see paged_attention."""
    if q.shape[1] != 1:
        raise ValueError(f"decode takes one query per head, got {q.shape[1]}")
    return paged_attention(q, k_pages, v_pages, page_table, q_len, k_recent, v_recent, **kw)


def verify_attention(q, k_pages, v_pages, page_table, q_len, k_recent, v_recent, **kw):
    """2..8 draft queries per head sharing one page scan, causal among themselves."""
    if not 1 <= q.shape[1] <= 8:
        raise ValueError(f"verify takes 1..8 queries per head, got {q.shape[1]}")
    return paged_attention(q, k_pages, v_pages, page_table, q_len, k_recent, v_recent, **kw)


def prefill_attention(q, k_pages, v_pages, page_table, q_len, k_recent, v_recent, *, scale,
                      group_size=64, bits=4, rotation=None, run_pages=8, backend=None):
    """A prefill chunk q [HQ, L, D] (the last L tokens of the recent window) over pages + window.

    Pages are dequantized run_pages at a time into a workspace [H, run_pages*P, D] (the Metal
    dequant kernel, or MLX ops), attended with matmuls, and merged by online softmax, so the
    workspace and score block stay bounded by run_pages*P columns.
    """
    b = _pick(backend)
    dtype = q.dtype
    page_table = page_table.astype(mx.int32)
    if rotation is not None:
        q, k_recent, v_recent = _rotated_inputs(q, k_recent, v_recent, rotation)
    hq, nq, d = q.shape
    h = k_recent.shape[0]
    rep = hq // h
    total = q_len + k_recent.shape[1]
    qg = (q.astype(mx.float32) * scale).reshape(h, rep * nq, d)
    qpos = mx.tile(total - nq + mx.arange(nq), rep)[:, None]
    m = mx.full((h, rep * nq, 1), -mx.inf)
    l = mx.zeros((h, rep * nq, 1))
    acc = mx.zeros((h, rep * nq, d))
    blocks = []
    n = page_table.size
    for start in range(0, n, run_pages):
        blocks.append(("pages", page_table[start:start + run_pages], start))
    blocks.append(("recent", None, None))
    page_size = k_pages[0].shape[2]
    for kind, table, start in blocks:
        if kind == "recent":
            k, v, t0 = k_recent.astype(mx.float32), v_recent.astype(mx.float32), q_len
        else:
            k, v = (_dequant_run(p, table, group_size, bits, rotation, b) for p in (k_pages, v_pages))
            t0 = start * page_size
        pos = t0 + mx.arange(k.shape[1])
        keep = (pos[None, :] <= qpos) & ((pos < q_len)[None, :] if kind == "pages" else True)
        s = mx.where(keep, qg @ k.transpose(0, 2, 1), -mx.inf)
        m_new = mx.maximum(m, s.max(axis=-1, keepdims=True))
        safe = mx.where(mx.isinf(m_new), 0, m_new)
        c = mx.where(mx.isinf(m), 0, mx.exp(m - safe))
        p = mx.where(keep, mx.exp(s - safe), 0)
        l = l * c + p.sum(axis=-1, keepdims=True)
        acc = acc * c + p @ v
        m = m_new
        mx.eval(m, l, acc)  # bound the graph: one run's workspace is live at a time
    o = mx.where(l > 0, acc / mx.maximum(l, 1e-30), 0).reshape(hq, nq, d)
    if rotation is not None:
        o = reference.unrotate(o, rotation[2])
    return o.astype(dtype)


def _dequant_run(pages, table, group_size, bits, rotation, b):
    """One page run to float32 [H, n*P, D] through the chosen backend."""
    if b == "reference":
        if rotation is None:
            return reference.dequant_affine(*pages, table, group_size, bits, mx.float32)
        return reference.dequant_rotated(*pages, rotation[0], table, mx.float32)
    codebook = None if rotation is None else rotation[0]
    return dequant_pages(pages, table, dtype=mx.float32, group_size=group_size, bits=bits,
                         codebook=codebook, backend=b)
