"""Real Metal: kernels against the reference, and timed against the MLX-ops path (Apple only)."""

import time

import mlx.core as mx
import numpy as np
import pytest

import metal_kernels as mk

from metal_kernels.testing import case

pytestmark = [
    pytest.mark.metal,
    pytest.mark.skipif(not mx.metal.is_available(),
                       reason="needs Apple Metal hardware (mx.metal.is_available() is False)"),
]


def _timed(fn, reps=20):
    mx.eval(fn())
    t = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn())
    return (time.perf_counter() - t) / reps


@pytest.mark.parametrize("fmt", ["affine", "rotated"])
@pytest.mark.parametrize("d,hq,nq", [(64, 3, 1), (128, 8, 1), (256, 2, 1), (128, 8, 4)])
def test_attention_on_metal_matches_reference(fmt, d, hq, nq):
    *arrays, kw = case(fmt, mx.float16, d, 1, hq, nq, 32)
    got = mk.paged_attention(*arrays, backend="metal", **kw)
    want = mk.paged_attention(*arrays, backend="reference", **kw)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)),
                               np.array(want.astype(mx.float32)), atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("fmt", ["affine", "rotated"])
def test_seal_and_prefill_on_metal_match_reference(fmt):
    *arrays, kw = case(fmt, mx.bfloat16, 128, 2, 6, 5, 32, recent=8)
    got = mk.prefill_attention(*arrays, backend="metal", run_pages=2, **kw)
    want = mk.paged_attention(*arrays, backend="reference", **kw)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)),
                               np.array(want.astype(mx.float32)), atol=2e-2, rtol=2e-2)
    x = mx.random.normal((8, 256, 128)).astype(mx.float16)
    for a, b in zip(mk.seal_affine(x, group_size=64, backend="metal"),
                    mx.quantize(x, group_size=64, bits=4)):
        assert mx.array_equal(a, b)


@pytest.mark.parametrize("fmt", ["affine", "rotated"])
def test_decode_timing_against_mlx_ops(fmt, capsys):
    # ~600 tokens in 32 pages of 16 plus a 100-token window, 8 KV heads, GQA 4, head_dim 128.
    *arrays, kw = case(fmt, mx.float16, 128, 8, 32, 1, 64, n_pool=32,
                       table=tuple(range(32)), q_len=32 * 16 - 7, recent=100)
    metal = _timed(lambda: mk.paged_attention(*arrays, backend="metal", **kw))
    ops = _timed(lambda: mk.paged_attention(*arrays, backend="reference", **kw))
    with capsys.disabled():
        print(f"\n[{fmt}] decode attention: metal {metal * 1e3:.3f} ms, mlx ops {ops * 1e3:.3f} ms")
    assert metal > 0 and ops > 0
