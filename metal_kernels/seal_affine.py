"""Seal a full page: K or V [H, P, D] to affine codes, scales and biases, exactly as mx.quantize."""

import mlx.core as mx

from ._common import Kernel

# One thread per quantization group of G values: min/max, scale and bias (MLX's rounding rules),
# then G * BITS / 32 packed words. Groups are contiguous along D, rows are contiguous.
_SEAL_AFFINE_SOURCE = """
    constexpr int PER = 32 / BITS;
    constexpr float NB = float((1 << BITS) - 1);
    uint gi = thread_position_in_grid.x;
    auto xg = x + size_t(gi) * G;

    float w_max = static_cast<float>(xg[0]);
    float w_min = w_max;
    for (int i = 1; i < G; i++) {
        float v = static_cast<float>(xg[i]);
        w_max = metal::max(w_max, v);
        w_min = metal::min(w_min, v);
    }
    float scale = metal::max((w_max - w_min) / NB, 1e-7f);
    bool side = metal::abs(w_min) > metal::abs(w_max);
    scale = side ? scale : -scale;
    float edge = side ? w_min : w_max;
    float q0 = metal::rint(edge / scale);
    float bias = 0.0f;
    if (q0 != 0.0f) {
        scale = edge / q0;
        bias = edge;
    }
    scales[gi] = static_cast<T>(scale);
    biases[gi] = static_cast<T>(bias);

    auto out = codes + size_t(gi) * (G / PER);
    for (int w = 0; w < G / PER; w++) {
        uint32_t word = 0;
        for (int j = 0; j < PER; j++) {
            float q = metal::rint((static_cast<float>(xg[w * PER + j]) - bias) / scale);
            q = metal::clamp(q, 0.0f, NB);
            word |= uint32_t(q) << (BITS * j);
        }
        out[w] = word;
    }
"""

_seal_affine_kernel = Kernel(
    name="seal_affine",
    input_names=["x"],
    output_names=["codes", "scales", "biases"],
    source=_SEAL_AFFINE_SOURCE,
)


def seal_affine(x: mx.array, *, group_size: int = 64, bits: int = 4, backend: str = "metal"):
    """x [..., D] to (codes uint32 [..., D*bits/32], scales, biases [..., D/group_size])."""
    *lead, d = x.shape
    groups = x.size // group_size
    return _seal_affine_kernel(
        backend,
        inputs=[x],
        template=[("T", x.dtype), ("G", group_size), ("BITS", bits)],
        grid=(groups, 1, 1),
        threadgroup=(min(256, groups), 1, 1),
        output_shapes=[(*lead, d * bits // 32), (*lead, d // group_size), (*lead, d // group_size)],
        output_dtypes=[mx.uint32, x.dtype, x.dtype],
    )
