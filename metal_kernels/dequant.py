"""Dequantize a run of pages into a bounded workspace [H, n*P, D] for prefill attention."""

from ._common import Kernel

# One thread per packed word: (page i of the run, head h, slot s, word w) writes its
# 32 / BITS values to workspace row h * (n*P) + i*P + s. Rotated pages stay in rotated space.
_INDEX = """
    constexpr int PER = 32 / BITS;
    constexpr int WORDS = D / PER;
    uint gid = thread_position_in_grid.x;
    int n = page_table_shape[0];
    int H = threads_per_grid.x / (n * PAGE * WORDS);
    uint w = gid % WORDS;
    uint s = (gid / WORDS) % PAGE;
    uint h = (gid / (WORDS * PAGE)) % H;
    uint i = gid / (WORDS * PAGE * H);
    size_t row = (size_t(page_table[i]) * H + h) * PAGE + s;
    size_t orow = (size_t(h) * n + i) * PAGE + s;
    uint32_t word = codes[row * WORDS + w];
"""

_DEQUANT_AFFINE_SOURCE = _INDEX + """
    for (int j = 0; j < PER; j++) {
        uint e = w * PER + j;
        size_t g = row * (D / G) + e / G;
        float c = float((word >> (BITS * j)) & ((1u << BITS) - 1u));
        out[orow * D + e] = static_cast<T>(
            static_cast<float>(scales[g]) * c + static_cast<float>(biases[g]));
    }
"""

_DEQUANT_ROTATED_SOURCE = _INDEX + """
    float nrm = static_cast<float>(norms[row]);
    for (int j = 0; j < PER; j++) {
        out[orow * D + w * PER + j] = static_cast<T>(nrm * codebook[(word >> (4 * j)) & 15u]);
    }
"""

_dequant_affine = Kernel(
    name="dequant_pages_affine",
    input_names=["codes", "scales", "biases", "page_table"],
    output_names=["out"],
    source=_DEQUANT_AFFINE_SOURCE,
)

_dequant_rotated = Kernel(
    name="dequant_pages_rotated",
    input_names=["codes", "norms", "codebook", "page_table"],
    output_names=["out"],
    source=_DEQUANT_ROTATED_SOURCE,
)


def dequant_pages(pages, page_table, *, dtype, group_size=64, bits=4, codebook=None,
                  backend="metal"):
    """pages (codes, scales, biases) or (codes, norms) pools [N, H, P, ...] -> [H, n*P, D]."""
    codes = pages[0]
    _, h, p, words = codes.shape
    rotated = codebook is not None
    bits = 4 if rotated else bits
    d = words * 32 // bits
    n = page_table.shape[0]
    threads = n * h * p * words
    template = [("T", dtype), ("D", d), ("PAGE", p), ("BITS", bits)]
    if rotated:
        kernel, inputs = _dequant_rotated, [codes, pages[1], codebook, page_table]
    else:
        kernel, inputs = _dequant_affine, [*pages, page_table]
        template.append(("G", group_size))
    return kernel(
        backend,
        inputs=inputs,
        template=template,
        grid=(threads, 1, 1),
        threadgroup=(min(256, threads), 1, 1),
        output_shapes=[(h, n * p, d)],
        output_dtypes=[dtype],
    )[0]
