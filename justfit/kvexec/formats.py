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


def storage_dtype(kv, dtype):
    """The float dtype of what a quantized config stores (scales, biases, full-precision pages): 16-bit, so
    bfloat16 when the model computes in float32 (half the bytes; widening it back is a shift, 5-8x cheaper than
    float16's on MLX's CPU backend, and quality is the same within noise: FORMAT.md); a model already in 16 bits
    keeps its dtype, and bits=16 (the lossless reference) stores as it gets."""
    return mx.bfloat16 if kv.bits != 16 and dtype == mx.float32 else dtype


class Codec:
    """What every codec shares: parts keep tokens on axis 1, `width(n)` entries of it for n tokens."""

    def width(self, n: int) -> int:
        return n

    @staticmethod
    def widened(parts, dtype):
        """(codes, scales, biases) with scales and biases in dtype: given 16-bit scales, MLX's quantized_matmul
        and dequantize compute in 16 bits (off by ~1e-3 relative); widened first, they are exact in float32."""
        codes, *rest = parts
        return (codes, *(a.astype(dtype) for a in rest))

    def take(self, parts, n: int):
        """Parts of a page's first n tokens (a partial page after a trim), whole storage units."""
        return tuple(a[:, : self.width(n)] for a in parts)


class FullCodec(Codec):
    """bits=16: the page is the float array itself, in the dtype it arrived in."""

    name = "fp"

    def __init__(self, head_dim: int, store=None):
        self.head_dim, self.store = head_dim, store  # store: the dtype kept (None: as it arrives)

    def encode(self, x):
        """The page as one contiguous array: K/V arrive as a transposed view of the projections (token-major), and
        a sealed page kept that way holds the whole projection buffer and is not laid out per head (the CPU
        kernel reads heads in place: cpu/q4.c)."""
        return (mx.contiguous(x if self.store is None else x.astype(self.store)),)

    def decode(self, parts):
        return parts[0]

    def widened(self, parts, dtype):
        """The page in dtype (16-bit storage read by a float32 model)."""
        return (parts[0].astype(dtype),)

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

    def __init__(self, head_dim: int, bits: int, group_size: int, store=None):
        self.head_dim, self.bits, self.group_size, self.store = head_dim, bits, group_size, store
        self.dim = math.ceil(head_dim / group_size) * group_size

    def _q(self):
        return dict(group_size=self.group_size, bits=self.bits)

    def encode(self, x):
        return self.stored(mx.quantize(_pad(x, self.dim), **self._q()))

    def stored(self, parts):
        """(codes, scales, biases) with scales and biases in the storage dtype."""
        codes, scales, biases = parts
        if self.store is None:
            return codes, scales, biases
        return codes, scales.astype(self.store), biases.astype(self.store)

    def decode(self, parts, dtype=mx.float32):
        return mx.dequantize(*self.widened(parts, dtype), **self._q())[..., : self.head_dim]

    def prepare(self, q):
        return _pad(q, self.dim)

    def scores(self, qc, parts):
        if qc.shape[-2] >= DEQUANT_ROWS:  # many queries (prefill): dequantize this run once, then GEMM
            return qc @ mx.dequantize(*self.widened(parts, qc.dtype), **self._q()).swapaxes(-1, -2)
        return mx.quantized_matmul(qc, *self.widened(parts, qc.dtype), transpose=True, **self._q())

    def mix(self, p, parts):
        if p.shape[-2] >= DEQUANT_ROWS:
            return p @ mx.dequantize(*self.widened(parts, p.dtype), **self._q())
        return mx.quantized_matmul(p, *self.widened(parts, p.dtype), transpose=False, **self._q())

    def finish(self, o):
        return o[..., : self.head_dim]


class ChannelCodec(Codec):
    """Keys only, bits 4/8: each channel quantized along tokens in groups of `group_size` tokens (KIVI-style
    per-channel keys), so a few large-magnitude channels no longer set the scale of every other channel.
    Stored [H, P/g, D, g*bits/32] words with scales and biases [H, P/g, D, 1]: axis 1 still runs along
    tokens (in groups), so pages of a run concatenate on it like every other format."""

    name = "channel"

    def __init__(self, head_dim: int, bits: int, group_size: int, store=None):
        self.head_dim, self.bits, self.group_size, self.store = head_dim, bits, group_size, store
        self.dim = head_dim

    def _q(self):
        return dict(group_size=self.group_size, bits=self.bits)

    def encode(self, x):
        from metal_kernels.reference import seal_channel  # one definition, shared with the kernels' tests

        return seal_channel(x, self.group_size, self.bits, self.store)

    def decode(self, parts, dtype=mx.float32):
        y = mx.dequantize(*self.widened(parts, dtype), **self._q()).swapaxes(-1, -2)  # [H, G, g, D]
        return y.reshape(y.shape[0], -1, y.shape[-1])

    def prepare(self, q):
        return q

    def scores(self, qc, parts):
        if qc.shape[-2] >= DEQUANT_ROWS:
            return qc @ self.decode(parts, qc.dtype).swapaxes(-1, -2)
        s = mx.quantized_matmul(qc[:, None], *self.widened(parts, qc.dtype), transpose=False, **self._q())  # [H, G, M, g]
        return s.swapaxes(1, 2).reshape(qc.shape[0], qc.shape[1], -1)

    def mix(self, p, parts):
        return p @ self.decode(parts, p.dtype)

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


def make_codecs(kv, head_dim: int, dtype=mx.float32):
    """(key codec, value codec) for a KVConfig and the dtype K/V arrive in; bits=16 gives FullCodec for both."""
    if kv.bits == 16:
        return FullCodec(head_dim), FullCodec(head_dim)
    store = storage_dtype(kv, dtype)

    def codec(fmt, bits, seed):
        if fmt == "rotated":
            return RotatedCodec(head_dim, seed)
        if fmt == "channel":  # token groups: the group size, or the largest smaller one that divides a page
            group = next(g for g in (128, 64, 32) if g <= kv.group_size and kv.page_size % g == 0)
            return ChannelCodec(head_dim, bits, group, store)
        return AffineCodec(head_dim, bits, kv.group_size, store)

    key = codec(kv.keys, kv.key_bits or kv.bits, rotation.KEY_SEED)
    return key, codec(kv.format, kv.bits, rotation.VALUE_SEED)


def full_codecs(kv, key_dim: int, value_dim: int, dtype=mx.float32):
    """(key codec, value codec) of a config's full-precision pages (open, and sealed before quantized_kv_start)."""
    store = storage_dtype(kv, dtype)
    return FullCodec(key_dim, store), FullCodec(value_dim, store)


def concat_parts(parts_list) -> tuple:
    """Several pages' parts tuples joined along the token axis (1), part by part; one page's parts as they are."""
    return tuple(mx.concatenate(list(col), axis=1) if len(col) > 1 else col[0] for col in zip(*parts_list))


def parts_nbytes(parts) -> int:
    return sum(a.nbytes for a in parts)
