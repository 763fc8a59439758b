"""The emulator itself: Metal semantics it reproduces, and planted bugs it must catch."""

import mlx.core as mx
import numpy as np
import pytest

from metal_kernels import dequant, emulator, reference as ref
from metal_kernels._common import Kernel
from metal_kernels.attention_pass1 import _pass1_affine
from metal_kernels.emulator import EmulatorError, build, metal_kernel

from metal_kernels.testing import NO_GXX, case

pytestmark = pytest.mark.skipif(not emulator.available(), reason=NO_GXX)

# A threadgroup sum through shared memory; BARRIER is where a barrier belongs.
_TG_SUM = """
    uint tid = thread_position_in_threadgroup.x;
    threadgroup float buf[64];
    buf[tid] = a[thread_position_in_grid.x];
    BARRIER
    if (tid == 0) {
        float s = 0.0f;
        for (int i = 0; i < 64; i++) {
            s += buf[i];
        }
        out[threadgroup_position_in_grid.x] = s;
    }
"""


def run(source, inputs, out_shape, grid, tg, out_dtype=mx.float32, name="planted", **kw):
    k = metal_kernel(name, [f"a{i}" if i else "a" for i in range(len(inputs))], ["out"], source)
    return k(inputs=inputs, grid=grid, threadgroup=tg, output_shapes=[out_shape],
             output_dtypes=[out_dtype], **kw)[0]


def test_threadgroup_memory_shared_per_group_with_barrier():
    a = mx.arange(128, dtype=mx.float32)
    src = _TG_SUM.replace("BARRIER", "threadgroup_barrier(mem_flags::mem_threadgroup);")
    out = run(src, [a], (2,), (128, 1, 1), (64, 1, 1), name="tg_sum")
    np.testing.assert_array_equal(np.array(out), [sum(range(64)), sum(range(64, 128))])


def test_catches_missing_barrier():
    with pytest.raises(EmulatorError, match="depends on the thread order"):
        run(_TG_SUM.replace("BARRIER", ""), [mx.arange(128, dtype=mx.float32)], (2,),
            (128, 1, 1), (64, 1, 1), name="tg_sum_nobarrier")


def test_catches_missing_bounds_check_read():
    src = "out[thread_position_in_grid.x] = a[thread_position_in_grid.x] * 2.0f;"
    with pytest.raises(EmulatorError, match="out-of-bounds read of 'a'"):
        run(src, [mx.ones((100,))], (128,), (128, 1, 1), (32, 1, 1), name="oob_read")


def test_catches_out_of_bounds_write():
    src = "uint i = thread_position_in_grid.x; if (i < 100) out[i + 1] = a[i];"
    with pytest.raises(EmulatorError, match="out-of-bounds write of 'out'"):
        run(src, [mx.ones((100,))], (100,), (100, 1, 1), (32, 1, 1), name="oob_write")


def test_catches_negative_index_read():
    src = "uint i = thread_position_in_grid.x; out[i] = a[int(i) - 1];"
    with pytest.raises(EmulatorError, match="out-of-bounds read of 'a'"):
        run(src, [mx.ones((1024,))], (1024,), (1024, 1, 1), (256, 1, 1), name="neg_read")


def test_catches_write_to_input():
    src = "uint i = thread_position_in_grid.x; const_cast<device float*>(a)[i] = 0; out[i] = 1;"
    with pytest.raises(EmulatorError, match="write to read-only input 'a'"):
        run(src, [mx.ones((64,))], (64,), (64, 1, 1), (32, 1, 1), name="input_write")


def test_catches_unwritten_output():
    src = "uint i = thread_position_in_grid.x; if (i % 2 == 0) out[i] = a[i];"
    with pytest.raises(EmulatorError, match="32 element\\(s\\) never written"):
        run(src, [mx.ones((64,))], (64,), (64, 1, 1), (32, 1, 1), name="unwritten")


def test_init_value_allows_partial_writes():
    src = "uint i = thread_position_in_grid.x; if (i % 2 == 0) out[i] = a[i];"
    out = run(src, [mx.ones((64,))], (64,), (64, 1, 1), (32, 1, 1), name="unwritten",
              init_value=5)
    assert np.array(out)[1] == 5 and np.array(out)[0] == 1


def test_catches_divergent_barrier():
    src = """
    uint i = thread_position_in_grid.x;
    if (thread_index_in_simdgroup < 16) {
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    out[i] = a[i];
"""
    with pytest.raises(EmulatorError, match="threadgroup_barrier in divergent code"):
        run(src, [mx.ones((64,))], (64,), (64, 1, 1), (64, 1, 1), name="div_barrier")


def test_catches_early_return_before_barrier():
    src = """
    uint i = thread_position_in_grid.x;
    if (i >= 60) return;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[i] = a[i];
"""
    with pytest.raises(EmulatorError, match="threadgroup_barrier in divergent code"):
        run(src, [mx.ones((64,))], (64,), (64, 1, 1), (64, 1, 1), name="early_return")


def test_catches_divergent_simd_op():
    src = """
    uint i = thread_position_in_grid.x;
    float v = a[i];
    if (thread_index_in_simdgroup < 16) {
        v = simd_sum(v);
    }
    out[i] = v;
"""
    with pytest.raises(EmulatorError, match="simd op in divergent code"):
        run(src, [mx.ones((64,))], (64,), (64, 1, 1), (64, 1, 1), name="div_simd")


def test_catches_uninitialized_accumulator():
    src = """
    uint i = thread_position_in_grid.x;
    float acc[4];
    for (int j = 0; j < 4; j++) {
        acc[j] += a[i * 4 + j];
    }
    out[i] = acc[0] + acc[1] + acc[2] + acc[3];
"""
    with pytest.raises(EmulatorError, match="depends on the thread order"):
        run(src, [mx.ones((256,))], (64,), (64, 1, 1), (32, 1, 1), name="uninit_acc")


def test_catches_missing_bound_in_real_attention_kernel():
    # The recent-window split reads one token past the window: a guard page stops it.
    bad = Kernel(**{**_pass1_affine.spec, "name": "pass1_no_bound", "source":
                    _pass1_affine.spec["source"].replace("? total :", "? total + 1 :")})
    *arrays, kw = case("affine", mx.float16, 64, 1, 3, 1, 32, recent=3)
    q, kp, vp, table, q_len, kr, vr = arrays
    with pytest.raises(EmulatorError, match="out-of-bounds read of 'k_recent'"):
        bad("emulator", inputs=[q, *kp, *vp, table, kr, vr, mx.array([q_len, 3], mx.int32),
                                mx.array(0.125)],
            template=[("D", 64), ("NQ", 1), ("PPS", 2), ("PAGE", 16), ("G", 32), ("BITS", 4)],
            grid=(96, 1, 3), threadgroup=(96, 1, 1),
            output_shapes=[(3, 3, 1, 64), (3, 3, 1), (3, 3, 1)], output_dtypes=[mx.float32] * 3)


def test_reference_catches_wrong_nibble_order(monkeypatch):
    # A plausible bug the emulator runs cleanly (no fault, no race) but the reference rejects.
    src = dequant._dequant_affine.spec["source"].replace(
        "(word >> (BITS * j))", "(word >> (BITS * (PER - 1 - j)))")
    assert src != dequant._dequant_affine.spec["source"]
    bad = Kernel(**{**dequant._dequant_affine.spec, "name": "dequant_bad_nibbles", "source": src})
    monkeypatch.setattr(dequant, "_dequant_affine", bad)
    _, kp, _, table, *_ = case("affine", mx.float16, 64, 1, 1, 1, 32)
    got = dequant.dequant_pages(kp, table, dtype=mx.float32, group_size=32, backend="emulator")
    want = ref.dequant_affine(*kp, table, 32, 4, mx.float32)
    assert not np.allclose(np.array(got), np.array(want), atol=1e-3)


def test_simd_functions_match_metal_semantics():
    src = """
    uint i = thread_position_in_grid.x;
    uint l = thread_index_in_simdgroup;
    float v = a[i];
    float r[10];
    r[0] = simd_sum(v);
    r[1] = simd_max(v);
    r[2] = simd_min(v);
    r[3] = simd_shuffle(v, ushort(31 - l));
    r[4] = simd_shuffle_xor(v, ushort(5));
    r[5] = simd_shuffle_down(v, ushort(3));
    r[6] = simd_shuffle_up(v, ushort(2));
    r[7] = simd_broadcast(v, ushort(7));
    r[8] = simd_prefix_inclusive_sum(v);
    r[9] = simd_prefix_exclusive_sum(v);
    for (int k = 0; k < 10; k++) {
        out[i * 10 + k] = r[k];
    }
"""
    a = np.random.default_rng(0).integers(-50, 50, 64).astype(np.float32)
    out = np.array(run(src, [mx.array(a)], (64, 10), (64, 1, 1), (64, 1, 1), name="simd_ops"))
    for sg in range(2):
        v = a[sg * 32:(sg + 1) * 32]
        lanes = np.arange(32)
        o = out[sg * 32:(sg + 1) * 32]
        np.testing.assert_array_equal(o[:, 0], v.sum())
        np.testing.assert_array_equal(o[:, 1], v.max())
        np.testing.assert_array_equal(o[:, 2], v.min())
        np.testing.assert_array_equal(o[:, 3], v[31 - lanes])
        np.testing.assert_array_equal(o[:, 4], v[lanes ^ 5])
        np.testing.assert_array_equal(o[:, 5], np.where(lanes + 3 < 32, v[np.minimum(lanes + 3, 31)], v))
        np.testing.assert_array_equal(o[:, 6], np.where(lanes >= 2, v[np.maximum(lanes - 2, 0)], v))
        np.testing.assert_array_equal(o[:, 7], v[7])
        np.testing.assert_array_equal(o[:, 8], np.cumsum(v))
        np.testing.assert_array_equal(o[:, 9], np.cumsum(v) - v)


def test_half_and_bfloat_round_like_metal():
    # Each op rounds to the storage type (nearest even), as Metal and MLX's own CPU ops do.
    src = """
    uint i = thread_position_in_grid.x;
    out[i] = T(a[i]) * T(a1[i]) + T(a1[i]);
"""
    rng = np.random.default_rng(1)
    x, y = (mx.array(rng.standard_normal(256).astype(np.float32)) for _ in range(2))
    for dtype in (mx.float16, mx.bfloat16):
        k = metal_kernel("round_" + str(dtype).split(".")[-1], ["a", "a1"], ["out"], src)
        out = k(inputs=[x, y], template=[("T", dtype)], grid=(256, 1, 1),
                threadgroup=(64, 1, 1), output_shapes=[(256,)], output_dtypes=[dtype])[0]
        want = x.astype(dtype) * y.astype(dtype) + y.astype(dtype)
        np.testing.assert_array_equal(np.array(out.view(mx.uint16)), np.array(want.view(mx.uint16)))


def test_grid_attributes_and_partial_threadgroups():
    src = """
    uint3 p = thread_position_in_grid;
    uint i = p.z * 6 * 5 + p.y * 6 + p.x;
    out[i * 4 + 0] = threadgroup_position_in_grid.x + 10 * threadgroup_position_in_grid.y;
    out[i * 4 + 1] = thread_position_in_threadgroup.x + 10 * thread_position_in_threadgroup.y;
    out[i * 4 + 2] = threads_per_threadgroup.x * threads_per_threadgroup.y;
    out[i * 4 + 3] = a[0] + threads_per_grid.x;
"""
    out = np.array(run(src, [mx.array([0], mx.uint32)], (2, 5, 6, 4), (6, 5, 2), (4, 2, 1),
                       out_dtype=mx.uint32, name="grid_attrs"))
    z, y, x = 1, 4, 5  # last group in x and y is partial: x 4..5 (2 wide), y 4 (1 high)
    assert list(out[z, y, x]) == [1 + 10 * 2, 1 + 10 * 0, 2 * 1, 6]


def test_objects_cached_by_source_hash():
    k = metal_kernel("cached", ["a"], ["out"], "out[thread_position_in_grid.x] = a[0];")
    specs = [(mx.float32, (4,))]
    cpp = k.cpp_for(specs, [], [mx.float32])
    k(inputs=[mx.ones((4,))], grid=(4, 1, 1), threadgroup=(4, 1, 1),
      output_shapes=[(4,)], output_dtypes=[mx.float32])
    path = build.object_path(cpp)
    assert path.exists() and path.parent == build.cache_dir()
    other = metal_kernel("cached", ["a"], ["out"], "out[thread_position_in_grid.x] = a[1];")
    assert build.object_path(other.cpp_for(specs, [], [mx.float32])) != path


def test_missing_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-g++")
    assert not emulator.available()
    with pytest.raises(build.BuildError, match="g\\+\\+ not found"):
        build.load("// a translation unit no test compiled before\n")
