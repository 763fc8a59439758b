"""Seeded random Hadamard rotation and the Lloyd-Max codebook of the rotated 4-bit format.

A unit vector rotated by (1/sqrt(Dp)) * WHT(s * u) has coordinates that all follow the same density
(1 - t^2)^((Dp-3)/2) on [-1, 1], so one fixed 16-level codebook fits every head and every token.
"""

from functools import lru_cache

import mlx.core as mx
import numpy as np

KEY_SEED = 0x4B  # keys and values use different sign vectors (FORMAT.md)
VALUE_SEED = 0x56


def padded_dim(d: int) -> int:
    """Dp: d rounded up to a power of two (the WHT needs one)."""
    return 1 << (d - 1).bit_length()


@lru_cache(maxsize=None)
def _hadamard_np(dp: int) -> np.ndarray:
    h = np.ones((1, 1), dtype=np.float32)
    while h.shape[0] < dp:  # Sylvester order: H_2n = [[H, H], [H, -H]]
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(dp)


@lru_cache(maxsize=None)
def hadamard(dp: int) -> mx.array:
    """The normalized, symmetric, self-inverse Walsh-Hadamard matrix (1/sqrt(Dp)) * H_Dp."""
    return mx.array(_hadamard_np(dp))


@lru_cache(maxsize=None)
def signs(seed: int, dp: int) -> mx.array:
    """The +-1 sign vector s of length Dp drawn from `seed` (numpy PCG64, so it is stable across MLX versions)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    return mx.array(np.where(rng.random(dp) < 0.5, -1.0, 1.0).astype(np.float32))


def rotate(x: mx.array, s: mx.array) -> mx.array:
    """y = (1/sqrt(Dp)) * WHT(s * x) along the last axis (x already padded to Dp)."""
    return (x * s) @ hadamard(x.shape[-1])


def unrotate(y: mx.array, s: mx.array) -> mx.array:
    """Inverse of rotate: s * (1/sqrt(Dp)) * WHT(y)."""
    return (y @ hadamard(y.shape[-1])) * s


@lru_cache(maxsize=None)
def _codebook_np(dp: int, levels: int = 16, iters: int = 200) -> np.ndarray:
    t = np.linspace(-1.0, 1.0, 100_001)[1:-1]
    w = np.exp(0.5 * (dp - 3) * np.log1p(-t * t))  # coordinate density of a rotated unit vector
    cdf = np.cumsum(w) / w.sum()
    c = np.interp((np.arange(levels) + 0.5) / levels, cdf, t)  # start at the quantiles
    for _ in range(iters):  # Lloyd-Max: boundaries at midpoints, levels at cell centroids
        cell = np.searchsorted((c[1:] + c[:-1]) / 2, t)
        c = np.bincount(cell, w * t, levels) / np.maximum(np.bincount(cell, w, levels), 1e-30)
    c = np.sort(c)
    return ((c - c[::-1]) / 2).astype(np.float32)  # the density is even: make the levels exactly symmetric


@lru_cache(maxsize=None)
def codebook(dp: int) -> mx.array:
    """The 16 sorted Lloyd-Max levels for dimension Dp."""
    return mx.array(_codebook_np(dp))


@lru_cache(maxsize=None)
def boundaries(dp: int) -> mx.array:
    """The 15 decision thresholds (midpoints between levels): code = number of thresholds below y."""
    c = _codebook_np(dp)
    return mx.array((c[1:] + c[:-1]) / 2)


@lru_cache(maxsize=None)
def level_fn(dp: int):
    """A compiled function: packed uint32 words [..., Dp/8] -> codebook levels c[code] [..., Dp].

    The 16 symmetric levels are interpolated exactly (to float rounding) by an odd degree-15
    polynomial in t = code/7.5 - 1, which MLX fuses with the nibble unpacking into one kernel.
    """
    c = _codebook_np(dp).astype(np.float64)
    t = (np.arange(8, 16) - 7.5) / 7.5
    coef = [float(a) for a in np.linalg.solve(np.stack([t**p for p in range(1, 16, 2)], 1), c[8:])]
    shifts = mx.arange(0, 32, 4, dtype=mx.uint32)

    def levels(packed):
        x = ((packed[..., None] >> shifts) & 15).astype(mx.float32) * (1 / 7.5) - 1.0
        x2, acc = x * x, coef[-1]
        for a in coef[-2::-1]:
            acc = acc * x2 + a
        return acc * x

    fused = mx.compile(levels, shapeless=True)  # shapeless: page runs differ in length
    return lambda packed: fused(packed).reshape(*packed.shape[:-1], packed.shape[-1] * 8)
