"""JustFit's Metal kernels for the paged 4-bit KV cache, their MLX-ops reference and dispatch.

KVExec calls the functions re-exported here; each runs the Metal kernel when Metal is available
and the MLX-ops reference otherwise (JUSTFIT_KERNELS=metal|reference|emulator forces one).
"""

from ._common import backend
from .ops import (
    decode_attention,
    paged_attention,
    prefill_attention,
    seal_affine,
    seal_rotated,
    verify_attention,
)

__all__ = [
    "backend",
    "decode_attention",
    "paged_attention",
    "prefill_attention",
    "seal_affine",
    "seal_rotated",
    "verify_attention",
]
