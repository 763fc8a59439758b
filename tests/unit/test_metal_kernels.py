"""Every kernel against its MLX-ops reference, run on the emulator (small shapes, edge cases)."""

import mlx.core as mx
import numpy as np
import pytest

import metal_kernels as mk
from metal_kernels import emulator
from metal_kernels import _common, reference as ref
from metal_kernels.attention_pass1 import attention_pass1
from metal_kernels.attention_pass2 import attention_pass2
from metal_kernels.dequant import dequant_pages
from metal_kernels.emulator import build

from metal_kernels.testing import NO_GXX, PAGE, case, codebook, signs

pytestmark = pytest.mark.skipif(not emulator.available(), reason=NO_GXX)
EMU = "emulator"


SEAL_AFFINE = [(mx.float16, 32, 4, 64), (mx.bfloat16, 64, 4, 128), (mx.float32, 64, 8, 64)]
SEAL_ROTATED = [(mx.float16, 64), (mx.bfloat16, 128), (mx.float16, 256)]
EDGES = {"no_recent": {"recent": 0}, "no_pages": {"table": (), "q_len": 0},
         "one_token": {"table": (1,), "q_len": 1, "recent": 0}}


@pytest.fixture(scope="module", autouse=True)
def precompiled():
    """Collect every kernel instance this module runs (backend 'plan') and compile in parallel."""
    _common.PLANNED.clear()
    plan = "plan"
    for dtype, group, bits, d in SEAL_AFFINE:
        mk.seal_affine(mx.zeros((2, PAGE, d), dtype), group_size=group, bits=bits, backend=plan)
    for dtype, d in SEAL_ROTATED:
        mk.seal_rotated(mx.zeros((2, PAGE, d), dtype), signs(d, 3), codebook(), backend=plan)
    cases = [case(*c) for c in ATTENTION_CASES]
    cases += [case(f, mx.float16, 64, 2, 2, 1, 32, **e) for f in FORMATS for e in EDGES.values()]
    for *arrays, kw in cases:
        mk.paged_attention(*arrays, backend=plan, pages_per_split=2, **kw)
    for fmt in FORMATS:
        *arrays, kw = case(fmt, mx.float16, 64, 1, 3, 5, 32, recent=8)
        mk.prefill_attention(*arrays, backend=plan, run_pages=2, **kw)
    build.compile_many(_common.PLANNED)
    _common.PLANNED.clear()


def f32(x):
    return np.array(x.astype(mx.float32))


def tol(dtype):
    return {mx.float16: 3e-3, mx.bfloat16: 2e-2, mx.float32: 1e-5}[dtype]


@pytest.mark.parametrize("dtype,group,bits,d", SEAL_AFFINE)
def test_seal_affine_matches_mx_quantize(dtype, group, bits, d):
    x = (mx.random.normal((2, PAGE, d), key=mx.random.key(1)) * 3).astype(dtype)
    got = mk.seal_affine(x, group_size=group, bits=bits, backend=EMU)
    want = mx.quantize(x, group_size=group, bits=bits)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(f32(g) if g.dtype != mx.uint32 else np.array(g),
                                      f32(w) if w.dtype != mx.uint32 else np.array(w))


@pytest.mark.parametrize("dtype,d", SEAL_ROTATED)
def test_seal_rotated_matches_reference(dtype, d):
    x = mx.random.normal((2, PAGE, d), key=mx.random.key(2)).astype(dtype)
    s, cb = signs(d, 3), codebook()
    codes, norms = mk.seal_rotated(x, s, cb, backend=EMU)
    rc, rn = ref.seal_rotated(x, s, cb)
    assert codes.shape == (2, PAGE, d // 8) and norms.dtype == mx.float16
    agree = (np.array(ref.unpack(codes, 4)) == np.array(ref.unpack(rc, 4))).mean()
    assert agree > 0.995  # ulp-level sum-order differences may flip a code at a midpoint
    np.testing.assert_allclose(f32(norms), f32(rn), rtol=1e-3)
    # Round trip: dequantize and unrotate gives x back to 4-bit accuracy.
    y = cb[ref.unpack(codes, 4)] * norms.astype(mx.float32)[..., None]
    back = ref.unrotate(y, s)
    cos = (back * x.astype(mx.float32)).sum(-1) / (
        mx.linalg.norm(back, axis=-1) * mx.linalg.norm(x.astype(mx.float32), axis=-1))
    assert float(cos.min()) > 0.9


FORMATS = ["affine", "rotated"]
ATTENTION_CASES = [
    # fmt, dtype, d, h, hq, nq, group
    ("affine", mx.float16, 64, 2, 2, 1, 32),  # GQA 1
    ("affine", mx.float16, 64, 1, 3, 1, 32),  # GQA 3
    ("affine", mx.float16, 64, 1, 8, 1, 32),  # GQA 8
    ("affine", mx.bfloat16, 128, 1, 3, 1, 64),
    ("affine", mx.float16, 256, 2, 2, 1, 64),
    ("affine", mx.bfloat16, 64, 1, 3, 4, 64),  # verify: 4 queries, one scan
    ("affine", mx.float16, 128, 2, 4, 8, 32),  # verify: 8 queries, GQA 2
    ("rotated", mx.float16, 64, 2, 2, 1, 32),
    ("rotated", mx.bfloat16, 128, 1, 3, 1, 32),
    ("rotated", mx.float16, 256, 1, 8, 1, 32),
    ("rotated", mx.float16, 64, 1, 3, 4, 32),
]


@pytest.mark.parametrize("fmt,dtype,d,h,hq,nq,group", ATTENTION_CASES)
def test_paged_attention_matches_reference(fmt, dtype, d, h, hq, nq, group):
    args = case(fmt, dtype, d, h, hq, nq, group)
    *arrays, kw = args
    got = mk.paged_attention(*arrays, backend=EMU, pages_per_split=2, **kw)
    want = mk.paged_attention(*arrays, backend="reference", **kw)
    assert got.shape == (hq, nq, d) and got.dtype == dtype
    np.testing.assert_allclose(f32(got), f32(want), atol=tol(dtype), rtol=tol(dtype))


@pytest.mark.parametrize("fmt", ["affine", "rotated"])
@pytest.mark.parametrize("edge", list(EDGES))
def test_paged_attention_edges(fmt, edge):
    kwargs = EDGES[edge]
    *arrays, kw = case(fmt, mx.float16, 64, 2, 2, 1, 32, **kwargs)
    got = mk.paged_attention(*arrays, backend=EMU, pages_per_split=2, **kw)
    want = mk.paged_attention(*arrays, backend="reference", **kw)
    np.testing.assert_allclose(f32(got), f32(want), atol=3e-3, rtol=3e-3)


def test_pass1_partials_match_reference():
    q, kp, vp, table, q_len, kr, vr, kw = case("affine", mx.float32, 64, 1, 3, 2, 32)
    lengths = mx.array([q_len, kr.shape[1]], dtype=mx.int32)
    o, m, l = attention_pass1(q, kp, vp, table, lengths, kr, vr, scale=kw["scale"],
                              page_size=PAGE, pages_per_split=3, group_size=32, backend=EMU)
    deq = ref.dequant_affine(*kp, table, 32, 4, mx.float32)[:, :q_len]
    k = mx.concatenate([deq, kr], axis=1)
    v = mx.concatenate([ref.dequant_affine(*vp, table, 32, 4, mx.float32)[:, :q_len], vr], axis=1)
    ro, rm, rl = ref.attention_partials(q, k, v, q_len, table.size, PAGE, 3, kw["scale"])
    assert o.shape == ro.shape == (3, 3, 2, 64)
    np.testing.assert_allclose(np.array(m), np.array(rm), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(l), np.array(rl), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.array(o), np.array(ro), rtol=1e-4, atol=1e-4)
    out = attention_pass2(o, m, l, dtype=mx.float32, backend=EMU)
    np.testing.assert_allclose(np.array(out), np.array(ref.merge_partials(ro, rm, rl)),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["affine", "rotated"])
def test_dequant_pages_matches_reference(fmt):
    _, kp, _, table, *_, kw = case(fmt, mx.float16, 64, 2, 2, 1, 32)
    rot = kw["rotation"]
    got = dequant_pages(kp, table, dtype=mx.float32, group_size=32,
                        codebook=None if rot is None else rot[0], backend=EMU)
    if rot is None:
        want = ref.dequant_affine(*kp, table, 32, 4, mx.float32)
    else:
        want = ref.dequant_rotated(*kp, rot[0], table, mx.float32)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fmt", ["affine", "rotated"])
def test_prefill_matches_reference(fmt):
    # 5 prefill queries, the last 5 tokens of an 8-token recent window; run of 2 pages at a time.
    *arrays, kw = case(fmt, mx.float16, 64, 1, 3, 5, 32, recent=8)
    got = mk.prefill_attention(*arrays, backend=EMU, run_pages=2, **kw)
    want = mk.paged_attention(*arrays, backend="reference", **kw)
    assert got.shape == (3, 5, 64)
    np.testing.assert_allclose(f32(got), f32(want), atol=3e-3, rtol=3e-3)
    ref_prefill = mk.prefill_attention(*arrays, backend="reference", run_pages=3, **kw)
    np.testing.assert_allclose(f32(ref_prefill), f32(want), atol=3e-3, rtol=3e-3)
