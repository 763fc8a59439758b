"""Seal a full page in the rotated format: norm, seeded Hadamard rotation, 16-level codebook."""

import mlx.core as mx

from ._common import WHT_HEADER, Kernel
from .reference import rotation_scale

# One SIMD group per (head, token) row; lane holds the R = D / 32 contiguous values
# [lane*R, lane*R + R). The 8 / R lanes that share a packed word gather it with shuffles.
_SEAL_ROTATED_SOURCE = """
    constexpr int R = D / 32;
    uint row = thread_position_in_grid.x / 32;
    uint lane = thread_index_in_simdgroup;
    auto xr = x + size_t(row) * D + lane * R;

    float v[R];
    float ss = 0.0f;
    for (int j = 0; j < R; j++) {
        v[j] = static_cast<float>(xr[j]);
        ss += v[j] * v[j];
    }
    float norm = metal::sqrt(simd_sum(ss));
    float denom = metal::max(norm, 1.17549435e-38f);  // float32 tiny
    for (int j = 0; j < R; j++) {
        v[j] = static_cast<float>(signs[lane * R + j]) * (v[j] / denom);
    }
    wht_simd<R>(v, lane);

    float cb[16];
    for (int c = 0; c < 16; c++) {
        cb[c] = codebook[c];
    }
    uint32_t part = 0;
    for (int j = 0; j < R; j++) {
        float y = v[j] * rscale;
        uint best = 0;
        float bd = metal::abs(y - cb[0]);
        for (int c = 1; c < 16; c++) {
            float dd = metal::abs(y - cb[c]);
            if (dd < bd) {
                bd = dd;
                best = c;
            }
        }
        part |= best << (4 * ((lane * R + j) % 8));
    }
    uint32_t word = part;
    for (int k = 1; k < 8 / R; k++) {
        word |= simd_shuffle_down(part, ushort(k));
    }
    if ((lane * R) % 8 == 0) {
        codes[size_t(row) * (D / 8) + lane * R / 8] = word;
    }
    if (lane == 0) {
        norms[row] = static_cast<half>(norm);
    }
"""

_seal_rotated_kernel = Kernel(
    name="seal_rotated",
    input_names=["x", "signs", "codebook", "rscale"],
    output_names=["codes", "norms"],
    source=_SEAL_ROTATED_SOURCE,
    header=WHT_HEADER,
)


def seal_rotated(x: mx.array, signs: mx.array, codebook: mx.array, *, backend: str = "metal"):
    """x [..., D] (D a power of two, 32..256) to (codes uint32 [..., D/8], norms float16 [...])."""
    *lead, d = x.shape
    rows = x.size // d
    return _seal_rotated_kernel(
        backend,
        inputs=[x, signs.astype(mx.float32), codebook.astype(mx.float32), rotation_scale(d)],
        template=[("T", x.dtype), ("D", d)],
        grid=(rows * 32, 1, 1),
        threadgroup=(min(256, rows * 32), 1, 1),
        output_shapes=[(*lead, d // 8), tuple(lead)],
        output_dtypes=[mx.uint32, mx.float16],
    )
