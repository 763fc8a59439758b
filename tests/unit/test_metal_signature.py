"""The emulator builds the same kernel source MLX generates (signature, buffers, attributes, name).

With the MLX CPU wheel, exporting a function that calls mx.fast.metal_kernel makes MLX generate
the kernel's Metal source, which verbose=True prints. No compiler or GPU is needed.
"""

import re

import mlx.core as mx
import pytest

import metal_kernels as mk
from metal_kernels import _common
from metal_kernels.attention_pass2 import attention_pass2
from metal_kernels.dequant import dequant_pages

from metal_kernels.testing import case, codebook, signs


def _mlx_sources(capfd, fn, *args):
    """Run fn under mx.export_function with every kernel call verbose; (calls, printed sources)."""
    calls = []
    original = _common.Kernel.__call__

    def recording(self, backend, **call):
        calls.append((self, call))
        return original(self, "metal", verbose=True, **call)

    _common.Kernel.__call__ = recording
    try:
        capfd.readouterr()
        mx.export_function(lambda *a: None, fn, *args)
    finally:
        _common.Kernel.__call__ = original
    printed = capfd.readouterr().out
    sources = re.findall(r"Generated source code for `[^`]*`:\n```\n(.*?)\n```", printed, re.S)
    return calls, sources


def _emulator_source(kernel, call):
    specs = [(x.dtype, x.shape) for x in call["inputs"]]
    emu = kernel.build("emulator")
    return emu.source_for(specs, list(call.get("template") or []), call["output_dtypes"])[2]


def _check(capfd, fn, *args, expect):
    try:
        calls, sources = _mlx_sources(capfd, fn, *args)
    except (RuntimeError, ValueError) as e:  # an MLX build that cannot trace metal_kernel
        pytest.skip(f"this MLX cannot export metal_kernel calls: {e}")
    assert len(calls) == len(sources) == expect
    for (kernel, call), text in zip(calls, sources):
        assert _emulator_source(kernel, call) == text


def test_seal_signatures_match_mlx(capfd):
    x = mx.zeros((2, 16, 64), mx.float16)
    s, cb = signs(64, 1), codebook()

    def fn(x, s, cb):
        return [*mk.seal_affine(x, group_size=32, backend="metal"),
                *mk.seal_rotated(x, s, cb, backend="metal")]

    _check(capfd, fn, x, s, cb, expect=2)


@pytest.mark.parametrize("fmt", ["affine", "rotated", "channel"])
def test_attention_signatures_match_mlx(capfd, fmt):
    page = {"page": 64} if fmt == "channel" else {}  # channel key groups are 32+ tokens
    q, kp, vp, table, q_len, kr, vr, kw = case(fmt, mx.bfloat16, 128, 1, 3, 2, 32, **page)
    n = len(kp)

    def fn(q, table, kr, vr, *pages):
        return mk.paged_attention(q, pages[:n], pages[n:], table, q_len, kr, vr,
                                  backend="metal", **kw)

    _check(capfd, fn, q, table, kr, vr, *kp, *vp, expect=2)


@pytest.mark.parametrize("fmt", ["affine", "rotated"])
def test_prefill_dequant_signature_matches_mlx(capfd, fmt):
    # prefill_attention evaluates each page run (bounded memory), so trace its dequant kernel.
    _, kp, _, table, *_, kw = case(fmt, mx.float16, 64, 1, 1, 2, 32)
    cb = None if kw["rotation"] is None else kw["rotation"][0]

    def fn(table, *pages):
        return dequant_pages(pages, table, dtype=mx.float32, group_size=32, codebook=cb,
                             backend="metal")

    _check(capfd, fn, table, *kp, expect=1)


def test_scalar_small_and_shape_inputs_match_mlx(capfd):
    # 0-d inputs by reference, arrays under 8 elements in `constant`, _shape/_strides/_ndim.
    k = _common.Kernel(
        name="shapes", input_names=["a", "b", "s"], output_names=["o"],
        source="uint i = thread_position_in_grid.x; uint w = threads_per_simdgroup;\n"
               "o[i] = a[i] + b[0] * s + a_shape[0] + a_strides[0] + a_ndim + w;")

    def fn(a, b, s):
        return k("metal", inputs=[a, b, s], template=[("T", mx.float32), ("N", 3), ("F", True)],
                 grid=(8, 1, 1), threadgroup=(8, 1, 1), output_shapes=[(8,)],
                 output_dtypes=[mx.float32])

    _check(capfd, fn, mx.zeros((8,)), mx.zeros((3,), mx.int32), mx.array(1.0), expect=1)


def test_pass2_signature_matches_mlx(capfd):
    o, m, l = mx.zeros((3, 4, 2, 64)), mx.zeros((3, 4, 2)), mx.zeros((3, 4, 2))

    def fn(o, m, l):
        return attention_pass2(o, m, l, dtype=mx.float16, backend="metal")

    _check(capfd, fn, o, m, l, expect=1)
