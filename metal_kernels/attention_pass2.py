"""Split-K pass 2 of paged attention: merge the per-split partials of each query row."""

import mlx.core as mx

from ._common import Kernel

# One SIMD group per output row (query head, query); lane holds R = D / 32 contiguous values.
# Splits that saw no token have m = -inf and weigh nothing; a row with no token at all is 0.
_PASS2_SOURCE = """
    constexpr int R = D / 32;
    uint row = thread_position_in_grid.x / 32;
    uint lane = thread_index_in_simdgroup;
    int S = part_m_shape[0];
    size_t rows = size_t(part_m_shape[1]) * part_m_shape[2];

    float mmax = -INFINITY;
    for (int s = 0; s < S; s++) {
        mmax = metal::max(mmax, part_m[s * rows + row]);
    }
    float total = 0.0f;
    float acc[R];
    for (int j = 0; j < R; j++) {
        acc[j] = 0.0f;
    }
    for (int s = 0; s < S; s++) {
        float ms = part_m[s * rows + row];
        float w = metal::isinf(ms) ? 0.0f : metal::exp(ms - mmax);
        total += w * part_l[s * rows + row];
        for (int j = 0; j < R; j++) {
            acc[j] += w * part_o[(s * rows + row) * D + lane * R + j];
        }
    }
    for (int j = 0; j < R; j++) {
        out[size_t(row) * D + lane * R + j] = static_cast<T>(total > 0.0f ? acc[j] / total : 0.0f);
    }
"""

_pass2_kernel = Kernel(
    name="paged_attention_pass2",
    input_names=["part_o", "part_m", "part_l"],
    output_names=["out"],
    source=_PASS2_SOURCE,
)


def attention_pass2(part_o, part_m, part_l, *, dtype=mx.float32, backend="metal"):
    """Merge partials [S, HQ, NQ, D] into the attention output [HQ, NQ, D] in dtype."""
    _, hq, nq, d = part_o.shape
    rows = hq * nq
    return _pass2_kernel(
        backend,
        inputs=[part_o, part_m, part_l],
        template=[("T", dtype), ("D", d)],
        grid=(rows * 32, 1, 1),
        threadgroup=(min(256, rows * 32), 1, 1),
        output_shapes=[(hq, nq, d)],
        output_dtypes=[dtype],
    )[0]
