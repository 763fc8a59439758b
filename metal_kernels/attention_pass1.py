"""Split-K pass 1 of paged attention: one partial (max, sum, weighted V) per page run.

Serves decode (NQ = 1) and verify (NQ = 2..8 queries sharing one scan of the pages).
"""

import mlx.core as mx

from ._common import UNPACK_HEADER, Kernel

# Threadgroup (kv head, split): one SIMD group per query head of the GQA group, so the group's
# query heads read the same K/V rows. Lane holds R = D / 32 contiguous values of each row.
# Splits 0..S-2 cover PPS pages each; the last split covers the full-precision recent window.
# Query i (of NQ) sees token t iff t <= total - NQ + i (causal verify; decode sees everything).
_PASS1_SOURCE = """
    constexpr int R = D / 32;
    uint lane = thread_index_in_simdgroup;
    uint kvh = threadgroup_position_in_grid.y;
    uint split = threadgroup_position_in_grid.z;
    uint rep = threads_per_threadgroup.x / 32;
    uint qh = kvh * rep + simdgroup_index_in_threadgroup;
    int H = k_recent_shape[0];
    int RC = k_recent_shape[1];
    int P = PAGE;
    int n_pages = page_table_shape[0];
    int n_split_pages = (n_pages + PPS - 1) / PPS;
    int q_len = lengths[0];
    int total = q_len + lengths[1];

    float qv[NQ][R];
    float m[NQ], l[NQ], acc[NQ][R];
    for (int i = 0; i < NQ; i++) {
        for (int j = 0; j < R; j++) {
            qv[i][j] = static_cast<float>(q[(size_t(qh) * NQ + i) * D + lane * R + j]) * scale;
            acc[i][j] = 0.0f;
        }
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }

    bool recent = int(split) == n_split_pages;
    int t0 = recent ? q_len : int(split) * PPS * P;
    int t1 = recent ? total : metal::min((int(split) + 1) * PPS * P, q_len);
    for (int t = t0; t < t1; t++) {
        float kf[R], vf[R];
        float kmul = 1.0f;
        if (recent) {
            size_t off = (size_t(kvh) * RC + (t - q_len)) * D + lane * R;
            for (int j = 0; j < R; j++) {
                kf[j] = static_cast<float>(k_recent[off + j]);
                vf[j] = static_cast<float>(v_recent[off + j]);
            }
        } else {
            size_t row = (size_t(page_table[t / P]) * H + kvh) * P + t % P;
            LOAD_KV
        }
        for (int i = 0; i < NQ; i++) {
            float s = 0.0f;
            for (int j = 0; j < R; j++) {
                s += qv[i][j] * kf[j];
            }
            s = simd_sum(s) * kmul;
            if (t <= total - NQ + i) {
                float m_new = metal::max(m[i], s);
                float c = metal::exp(m[i] - m_new);
                float p = metal::exp(s - m_new);
                l[i] = l[i] * c + p;
                for (int j = 0; j < R; j++) {
                    acc[i][j] = acc[i][j] * c + p * vf[j];
                }
                m[i] = m_new;
            }
        }
    }

    size_t rows = size_t(threadgroups_per_grid.y) * rep * NQ;
    for (int i = 0; i < NQ; i++) {
        size_t r = split * rows + size_t(qh) * NQ + i;
        for (int j = 0; j < R; j++) {
            part_o[r * D + lane * R + j] = acc[i][j];
        }
        if (lane == 0) {
            part_m[r] = m[i];
            part_l[r] = l[i];
        }
    }
"""


def _load_affine(x):
    """MSL loading the lane's R values of K (x = "k") or V ("v") from affine pages: scale * code + bias;
    the lane's R values lie in one quantization group."""
    return """
            uint $0 = lane * R;
            size_t $g = row * (D / G) + $0 / G;
            float $s = static_cast<float>($_scales[$g]), $b = static_cast<float>($_biases[$g]);
            for (int j = 0; j < R; j++) {
                $f[j] = $s * float(unpack_code<BITS>($_codes + row * (D * BITS / 32), $0 + j)) + $b;
            }
""".replace("$", x)


_LOAD_K_AFFINE = _load_affine("k")

# Channel keys (KVExec's ChannelCodec): pool [N, H, P/KG, D, KG/8] words, scales/biases
# [N, H, P/KG, D, 1]; channel d of slot s is code s % KG of row ((page, head, s / KG), d).
_LOAD_K_CHANNEL = """
            int slot = t % P;
            size_t crow = ((size_t(page_table[t / P]) * H + kvh) * (P / KG) + slot / KG) * D + lane * R;
            for (int j = 0; j < R; j++) {
                float code = float(unpack_code<4>(k_codes + (crow + j) * (KG / 8), slot % KG));
                kf[j] = static_cast<float>(k_scales[crow + j]) * code + static_cast<float>(k_biases[crow + j]);
            }
"""

_LOAD_V_AFFINE = _load_affine("v")

# Rotated pages: score = norm_k * <q', c[code]>, weighted V = norm_v * c[code] (rotated space).
_LOAD_ROTATED = """
            uint e0 = lane * R;
            kmul = static_cast<float>(k_norms[row]);
            float vn = static_cast<float>(v_norms[row]);
            for (int j = 0; j < R; j++) {
                kf[j] = codebook[unpack_code<4>(k_codes + row * (D / 8), e0 + j)];
                vf[j] = vn * codebook[unpack_code<4>(v_codes + row * (D / 8), e0 + j)];
            }
"""

_OUTPUTS = ["part_o", "part_m", "part_l"]
_TAIL = ["page_table", "k_recent", "v_recent", "lengths", "scale"]

_AFFINE_INPUTS = ["q", "k_codes", "k_scales", "k_biases", "v_codes", "v_scales", "v_biases"] + _TAIL


def _affine_values(key, load_k):
    """A pass-1 kernel with affine values and keys loaded by load_k (affine or channel keys)."""
    return Kernel(
        name=f"paged_attention_pass1_{key}",
        input_names=_AFFINE_INPUTS,
        output_names=_OUTPUTS,
        source=_PASS1_SOURCE.replace("LOAD_KV", (load_k + _LOAD_V_AFFINE).strip()),
        header=UNPACK_HEADER,
    )


_pass1_affine = _affine_values("affine", _LOAD_K_AFFINE)
_pass1_channel = _affine_values("channel", _LOAD_K_CHANNEL)

_pass1_rotated = Kernel(
    name="paged_attention_pass1_rotated",
    input_names=["q", "k_codes", "k_norms", "v_codes", "v_norms", "codebook"] + _TAIL,
    output_names=_OUTPUTS,
    source=_PASS1_SOURCE.replace("LOAD_KV", _LOAD_ROTATED.strip()),
    header=UNPACK_HEADER,
)


def attention_pass1(q, k_pages, v_pages, page_table, lengths, k_recent, v_recent, *, scale,
                    page_size, pages_per_split=4, group_size=64, bits=4, codebook=None,
                    key_format="affine", key_group=None, backend="metal"):
    """Partials (o [S, HQ, NQ, D], m [S, HQ, NQ], l [S, HQ, NQ]) float32, S = splits + 1.

    q [HQ, NQ, D]; k_pages/v_pages (codes, scales, biases) pools [N, H, P, ...] for affine or
    (codes, norms) with codebook for rotated; key_format="channel" takes 4-bit channel keys
    (codes [N, H, P/key_group, D, key_group/8], scales/biases [N, H, P/key_group, D, 1]) with
    affine values; page_table int32 [n]; lengths int32 [2] = (tokens in the pages, tokens in
    the recent window); k_recent/v_recent [H, >=1, D] (rotated space for rotated pages).
    """
    hq, nq, d = q.shape
    h = k_recent.shape[0]
    splits = -(-page_table.shape[0] // pages_per_split) + 1
    rotated = codebook is not None
    template = [("D", d), ("NQ", nq), ("PPS", pages_per_split), ("PAGE", page_size)]
    if rotated:
        kernel, pages = _pass1_rotated, [k_pages[0], k_pages[1], v_pages[0], v_pages[1], codebook]
    else:
        kernel, pages = _pass1_affine, [*k_pages, *v_pages]
        template += [("G", group_size), ("BITS", bits)]
    if key_format == "channel":
        kernel = _pass1_channel
        template.append(("KG", key_group))
    return kernel(
        backend,
        inputs=[q, *pages, page_table, k_recent, v_recent, lengths, mx.array(scale, mx.float32)],
        template=template,
        grid=(32 * (hq // h), h, splits),
        threadgroup=(32 * (hq // h), 1, 1),
        output_shapes=[(splits, hq, nq, d), (splits, hq, nq), (splits, hq, nq)],
        output_dtypes=[mx.float32] * 3,
    )
