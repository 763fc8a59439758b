"""MLX-ops reference for every kernel: the path used off Apple GPUs and the tests' ground truth."""

import math

import mlx.core as mx

TINY = 1.17549435e-38  # float32 tiny: the norm floor of the rotated format


def wht(x: mx.array) -> mx.array:
    """Unnormalized Walsh-Hadamard transform on the last axis, stages in the kernels' order."""
    d = x.shape[-1]
    lead = x.shape[:-1]
    h = 1
    while h < d:
        y = x.reshape(*lead, d // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = mx.stack([a + b, a - b], axis=-2).reshape(*lead, d)
        h *= 2
    return x


def rotation_scale(d: int) -> mx.array:
    """1/sqrt(d) as float32, the one constant both paths use."""
    return mx.array(1.0 / math.sqrt(d), dtype=mx.float32)


def rotate(x: mx.array, signs: mx.array) -> mx.array:
    """(1/sqrt(D)) WHT(signs * x) in float32: into the rotated space."""
    return wht(x.astype(mx.float32) * signs.astype(mx.float32)) * rotation_scale(x.shape[-1])


def unrotate(y: mx.array, signs: mx.array) -> mx.array:
    """signs * (1/sqrt(D)) WHT(y): back from the rotated space."""
    return signs.astype(mx.float32) * (wht(y.astype(mx.float32)) * rotation_scale(y.shape[-1]))


def pack(codes: mx.array, bits: int) -> mx.array:
    """Pack codes (last axis) into uint32 words, low bits first."""
    per = 32 // bits
    c = codes.astype(mx.uint32).reshape(*codes.shape[:-1], -1, per)
    shifts = mx.array([1 << (bits * i) for i in range(per)], dtype=mx.uint32)
    return (c * shifts).sum(axis=-1).astype(mx.uint32)


def unpack(words: mx.array, bits: int) -> mx.array:
    """Inverse of pack: uint32 words to codes on the last axis."""
    per = 32 // bits
    shifts = mx.array([bits * i for i in range(per)], dtype=mx.uint32)
    c = (words[..., None] >> shifts) & ((1 << bits) - 1)
    return c.reshape(*words.shape[:-1], -1)


def seal_affine(x, group_size=64, bits=4):
    """A page [H, P, D] to (codes, scales, biases), exactly mx.quantize."""
    return mx.quantize(x, group_size=group_size, bits=bits)


def seal_rotated(x, signs, codebook):
    """A page [H, P, D] to (codes uint32 [H, P, D/8], norms float16 [H, P])."""
    xf = x.astype(mx.float32)
    norm = mx.sqrt((xf * xf).sum(axis=-1, keepdims=True))
    u = xf / mx.maximum(norm, TINY)
    y = rotate(u, signs)
    codes = mx.argmin(mx.abs(y[..., None] - codebook.astype(mx.float32)), axis=-1)
    return pack(codes, 4), norm[..., 0].astype(mx.float16)


def dequant_affine(codes, scales, biases, page_table, group_size, bits, dtype):
    """Pages of the table to [H, n*P, D] in dtype (the prefill workspace)."""
    # float32 scales: the kernels compute scale * code + bias in float32 too.
    sel = (codes[page_table], scales[page_table].astype(mx.float32),
           biases[page_table].astype(mx.float32))
    x = mx.dequantize(*sel, group_size=group_size, bits=bits)  # [n, H, P, D]
    n, h, p, d = x.shape
    return x.transpose(1, 0, 2, 3).reshape(h, n * p, d).astype(dtype)


def seal_channel(x, group_size=64, bits=4, dtype=None):
    """Channel keys: pages [..., P, D] quantized per channel along groups of g tokens (KVExec's
    ChannelCodec), (codes [..., P/g, D, g*bits/32], scales, biases [..., P/g, D, 1] in dtype or x's)."""
    *lead, p, d = x.shape
    return range_quantize(x.reshape(*lead, p // group_size, group_size, d).swapaxes(-1, -2), bits, dtype)


def range_quantize(t, bits=4, dtype=None):
    """Affine codes over each row's own [min, max] (rows of t [..., g]), in mx.quantize's layout so that
    mx.dequantize / quantized_matmul read them. Unlike mx.quantize it does not move the range to make an
    edge exact: on channel keys of two real documents top1 rose 0.6-1.2 points; KL moved within the
    +-10% that float-rounding perturbations alone cause. Scales and biases are stored in dtype (t's by
    default) and the codes are chosen against the stored, rounded values."""
    dtype = dtype or t.dtype
    t32 = t.astype(mx.float32)
    lo, hi = t32.min(axis=-1, keepdims=True), t32.max(axis=-1, keepdims=True)
    scale = mx.maximum((hi - lo) / (2**bits - 1), 1e-12).astype(dtype)
    lo = lo.astype(dtype)
    scale32, lo32 = mx.maximum(scale.astype(mx.float32), 1e-12), lo.astype(mx.float32)  # 0: a flat row
    q = mx.clip(mx.round((t32 - lo32) / scale32), 0, 2**bits - 1).astype(mx.uint32)
    per = 32 // bits
    q = q.reshape(*q.shape[:-1], q.shape[-1] // per, per)
    words = (q << (mx.arange(per, dtype=mx.uint32) * bits)).sum(axis=-1).astype(mx.uint32)
    return words, scale, lo


def dequant_channel(codes, scales, biases, page_table, group_size, dtype, bits=4):
    """Channel-key pages of the table to [H, n*P, D] in dtype (inverse of seal_channel)."""
    sel = (codes[page_table], scales[page_table].astype(mx.float32),
           biases[page_table].astype(mx.float32))
    x = mx.dequantize(*sel, group_size=group_size, bits=bits).swapaxes(-1, -2)  # [n, H, P/g, g, D]
    n, h, groups, g, d = x.shape
    return x.transpose(1, 0, 2, 3, 4).reshape(h, n * groups * g, d).astype(dtype)


def dequant_rotated(codes, norms, codebook, page_table, dtype):
    """Pages of the table to [H, n*P, D] in the rotated space: norm * codebook[code]."""
    c = unpack(codes[page_table], 4)
    x = codebook.astype(mx.float32)[c] * norms[page_table].astype(mx.float32)[..., None]
    n, h, p, d = x.shape
    return x.transpose(1, 0, 2, 3).reshape(h, n * p, d).astype(dtype)


def attention_partials(q, k, v, q_len, n_pages, page_size, pages_per_split, scale):
    """Pass 1: per split (page runs, then the recent window) the max, sum and weighted V.

    q [HQ, NQ, D] (rotated space for rotated pages); k, v [H, q_len + recent, D] float32 with the
    quantized tokens first. Returns (o [S, HQ, NQ, D], m [S, HQ, NQ], l [S, HQ, NQ]).
    """
    hq, nq, d = q.shape
    h, total, _ = k.shape
    rep = hq // h
    n_splits = -(-n_pages // pages_per_split)
    bounds = [(s * pages_per_split * page_size, min((s + 1) * pages_per_split * page_size, q_len))
              for s in range(n_splits)] + [(q_len, total)]
    qg = (q.astype(mx.float32) * scale).reshape(h, rep * nq, d)
    pos = mx.arange(total)
    limit = (total - nq + mx.arange(nq))[None, :, None]  # causal: query i sees t <= total-nq+i
    os_, ms, ls = [], [], []
    for t0, t1 in bounds:
        s = qg @ k.transpose(0, 2, 1)  # [H, rep*NQ, total]
        s = s.reshape(h, rep, nq, total)
        keep = (pos >= t0) & (pos < t1) & (pos[None, None, :] <= limit)[0]
        s = mx.where(keep, s, -mx.inf)
        m = s.max(axis=-1)
        p = mx.where(keep, mx.exp(s - mx.where(mx.isinf(m), 0, m)[..., None]), 0)
        os_.append((p.reshape(h, rep * nq, total) @ v).reshape(hq, nq, d))
        ms.append(m.reshape(hq, nq))
        ls.append(p.sum(axis=-1).reshape(hq, nq))
    return mx.stack(os_), mx.stack(ms), mx.stack(ls)


def merge_partials(o, m, l):
    """Pass 2: merge split partials [S, HQ, NQ, ...] into the output [HQ, NQ, D] (float32)."""
    mm = m.max(axis=0)
    w = mx.where(mx.isinf(m), 0, mx.exp(m - mx.where(mx.isinf(mm), 0, mm)))
    total = (w * l).sum(axis=0)
    acc = (w[..., None] * o).sum(axis=0)
    return mx.where(total[..., None] > 0, acc / mx.maximum(total, 1e-30)[..., None], 0)


def attention(q, k, v, scale):
    """Softmax attention of q [HQ, NQ, D] over k, v [H, T, D] (GQA), float32 out.

    Query i is the token at position T - NQ + i and sees tokens t <= T - NQ + i, which is
    decode (NQ = 1), verify and prefill alike.
    """
    hq, nq, d = q.shape
    h, t, _ = k.shape
    rep = hq // h
    qg = (q.astype(mx.float32) * scale).reshape(h, rep * nq, d)
    s = (qg @ k.astype(mx.float32).transpose(0, 2, 1)).reshape(h, rep, nq, t)
    visible = mx.arange(t)[None, :] <= (t - nq + mx.arange(nq))[:, None]
    s = mx.where(visible, s, -mx.inf)
    p = mx.softmax(s, axis=-1).reshape(h, rep * nq, t)
    return (p @ v.astype(mx.float32)).reshape(hq, nq, d)
