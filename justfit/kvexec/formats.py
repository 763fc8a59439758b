"""Page codecs: how one page of keys or values [H, T, D] is stored, and attention pieces on that storage.

Each codec turns a float page into a tuple of arrays (`encode`), back (`decode`, the reference), and
computes attention directly on the stored arrays without dequantizing more than the page run it is given:
`prepare` maps queries into the codec's space once per call, `scores` gives q.k for a run, `mix` gives
sum_j p_j v_j for a run in the codec's output space, and `finish` maps that sum back to head_dim.
Layouts follow /work/kv-format-contract.md and FORMAT.md.
"""

import math

import mlx.core as mx

from . import rotation

_SHIFTS4 = None
# With at least this many query rows per KV head, dequantizing a page run and using a float GEMM beats
# MLX's quantized matmul (no BLAS behind it on CPU); the run is bounded, so the workspace stays bounded.
DEQUANT_ROWS = 16


def _pad(x: mx.array, d: int) -> mx.array:
    extra = d - x.shape[-1]
    if extra == 0:
        return x
    return mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


class Codec:
    """What every codec shares: parts keep tokens on axis 1, `width(n)` entries of it for n tokens."""

    def width(self, n: int) -> int:
        return n

    def take(self, parts, n: int):
        """Parts of a page's first n tokens (a partial page after a trim), whole storage units."""
        return tuple(a[:, : self.width(n)] for a in parts)


class FullCodec(Codec):
    """bits=16: the page is the float array itself, in the dtype it arrived in."""

    name = "fp"

    def __init__(self, head_dim: int):
        self.head_dim = head_dim

    def encode(self, x):
        return (x,)

    def decode(self, parts):
        return parts[0]

    def prepare(self, q):
        return q

    def scores(self, qc, parts):
        return qc @ parts[0].astype(qc.dtype).swapaxes(-1, -2)

    def mix(self, p, parts):
        return p @ parts[0].astype(p.dtype)

    def finish(self, o):
        return o


class AffineCodec(Codec):
    """bits 4/8: `mx.quantize` along head_dim (zero-padded to a multiple of the group), scale and bias per group."""

    name = "affine"

    def __init__(self, head_dim: int, bits: int, group_size: int):
        self.head_dim, self.bits, self.group_size = head_dim, bits, group_size
        self.dim = math.ceil(head_dim / group_size) * group_size

    def _q(self):
        return dict(group_size=self.group_size, bits=self.bits)

    def encode(self, x):
        return tuple(mx.quantize(_pad(x, self.dim), **self._q()))

    def decode(self, parts):
        return mx.dequantize(*parts, **self._q())[..., : self.head_dim]

    def prepare(self, q):
        return _pad(q, self.dim)

    def scores(self, qc, parts):
        if qc.shape[-2] >= DEQUANT_ROWS:  # many queries (prefill): dequantize this run once, then GEMM
            return qc @ mx.dequantize(*parts, **self._q()).swapaxes(-1, -2)
        return mx.quantized_matmul(qc, *parts, transpose=True, **self._q())

    def mix(self, p, parts):
        if p.shape[-2] >= DEQUANT_ROWS:
            return p @ mx.dequantize(*parts, **self._q())
        return mx.quantized_matmul(p, *parts, transpose=False, **self._q())

    def finish(self, o):
        return o[..., : self.head_dim]


class ChannelCodec(Codec):
    """Keys only, bits 4/8: each channel quantized along tokens in groups of `group_size` tokens (KIVI-style
    per-channel keys), so a few large-magnitude channels no longer set the scale of every other channel.
    Stored [H, P/g, D, g*bits/32] words with scales and biases [H, P/g, D, 1]: axis 1 still runs along
    tokens (in groups), so pages of a run concatenate on it like every other format."""

    name = "channel"

    def __init__(self, head_dim: int, bits: int, group_size: int):
        self.head_dim, self.bits, self.group_size = head_dim, bits, group_size
        self.dim = head_dim

    def _q(self):
        return dict(group_size=self.group_size, bits=self.bits)

    def encode(self, x):
        from metal_kernels.reference import seal_channel  # one definition, shared with the kernels' tests

        return seal_channel(x, self.group_size, self.bits)

    def decode(self, parts):
        y = mx.dequantize(*parts, **self._q()).swapaxes(-1, -2)  # [H, G, g, D]
        return y.reshape(y.shape[0], -1, y.shape[-1])

    def prepare(self, q):
        return q

    def scores(self, qc, parts):
        if qc.shape[-2] >= DEQUANT_ROWS:
            return qc @ self.decode(parts).astype(qc.dtype).swapaxes(-1, -2)
        s = mx.quantized_matmul(qc[:, None], *parts, transpose=False, **self._q())  # [H, G, M, g]
        return s.swapaxes(1, 2).reshape(qc.shape[0], qc.shape[1], -1)

    def mix(self, p, parts):
        return p @ self.decode(parts).astype(p.dtype)

    def finish(self, o):
        return o

    def width(self, n: int) -> int:
        """Whole token groups: a partial page's scores gain up to g-1 columns that callers drop or mask."""
        return -(-n // self.group_size)


def unpack4(packed: mx.array) -> mx.array:
    """uint32 words [..., Dp/8] -> 4-bit codes [..., Dp], element i at bits 4*(i % 8) of word i // 8."""
    global _SHIFTS4
    if _SHIFTS4 is None:
        _SHIFTS4 = mx.arange(0, 32, 4, dtype=mx.uint32)
    codes = (packed[..., None] >> _SHIFTS4) & 15
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * 8)


def pack4(codes: mx.array) -> mx.array:
    """Inverse of unpack4: 4-bit codes [..., Dp] -> uint32 words [..., Dp/8] (low nibble first)."""
    c = codes.astype(mx.uint32).reshape(*codes.shape[:-1], codes.shape[-1] // 8, 8)
    return (c << mx.arange(0, 32, 4, dtype=mx.uint32)).sum(axis=-1).astype(mx.uint32)


class RotatedCodec(Codec):
    """4-bit rotated: fp16 norm per vector, random-sign Hadamard rotation, 16-level Lloyd-Max codebook."""

    name = "rotated"

    def __init__(self, head_dim: int, seed: int):
        self.head_dim, self.seed = head_dim, seed
        self.dim = rotation.padded_dim(head_dim)
        self.signs = rotation.signs(seed, self.dim)
        self.codebook = rotation.codebook(self.dim)
        self.bounds = rotation.boundaries(self.dim)

    def encode(self, x):
        x = _pad(x.astype(mx.float32), self.dim)
        norm = mx.sqrt((x * x).sum(axis=-1))
        y = rotation.rotate(x / mx.maximum(norm, 1e-30)[..., None], self.signs)
        codes = (y[..., None] > self.bounds).sum(axis=-1)
        return pack4(codes), norm.astype(mx.float16)

    def levels(self, packed):
        """Codebook values c[codes] in rotated space, float32 [..., Dp] (fused; a gather is 3x slower on CPU)."""
        return rotation.level_fn(self.dim)(packed)

    def decode(self, parts):
        packed, norm = parts
        y = self.levels(packed) * norm.astype(mx.float32)[..., None]
        return rotation.unrotate(y, self.signs)[..., : self.head_dim]

    def prepare(self, q):
        return rotation.rotate(_pad(q.astype(mx.float32), self.dim), self.signs)

    def scores(self, qc, parts):
        packed, norm = parts
        return (qc @ self.levels(packed).swapaxes(-1, -2)) * norm.astype(qc.dtype)[:, None, :]

    def mix(self, p, parts):
        packed, norm = parts
        return (p * norm.astype(p.dtype)[:, None, :]) @ self.levels(packed)

    def finish(self, o):
        return rotation.unrotate(o, self.signs)[..., : self.head_dim]


def make_codecs(kv, head_dim: int):
    """(key codec, value codec) for a KVConfig; bits=16 gives FullCodec for both."""
    if kv.bits == 16:
        return FullCodec(head_dim), FullCodec(head_dim)
    def codec(fmt, bits, seed):
        if fmt == "rotated":
            return RotatedCodec(head_dim, seed)
        if fmt == "channel":  # token groups: the group size, or the largest smaller one that divides a page
            group = next(g for g in (128, 64, 32) if g <= kv.group_size and kv.page_size % g == 0)
            return ChannelCodec(head_dim, bits, group)
        return AffineCodec(head_dim, bits, kv.group_size)

    key = codec(kv.keys, kv.key_bits or kv.bits, rotation.KEY_SEED)
    return key, codec(kv.format, kv.bits, rotation.VALUE_SEED)


def parts_nbytes(parts) -> int:
    return sum(a.nbytes for a in parts)
