"""Dispatch: backend choice, JUSTFIT_KERNELS, and the reference path's own correctness."""

import mlx.core as mx
import numpy as np
import pytest

import metal_kernels as mk
from metal_kernels import reference as ref

from metal_kernels.testing import case, codebook, signs


def test_backend_defaults_to_what_the_machine_has(monkeypatch):
    monkeypatch.delenv("JUSTFIT_KERNELS", raising=False)
    assert mk.backend() == ("metal" if mx.metal.is_available() else "reference")


@pytest.mark.parametrize("forced", ["reference", "emulator", "REFERENCE "])
def test_env_forces_backend(monkeypatch, forced):
    monkeypatch.setenv("JUSTFIT_KERNELS", forced)
    assert mk.backend() == forced.strip().lower()


def test_env_rejects_unknown_and_unavailable(monkeypatch):
    monkeypatch.setenv("JUSTFIT_KERNELS", "cuda")
    with pytest.raises(ValueError, match="JUSTFIT_KERNELS"):
        mk.backend()
    if not mx.metal.is_available():
        monkeypatch.setenv("JUSTFIT_KERNELS", "metal")
        with pytest.raises(RuntimeError, match="Metal is not available"):
            mk.backend()


def test_forced_reference_is_used_by_ops(monkeypatch):
    monkeypatch.setenv("JUSTFIT_KERNELS", "reference")
    x = mx.random.normal((2, 16, 64), key=mx.random.key(0))
    for a, b in zip(mk.seal_affine(x, group_size=32), mx.quantize(x, group_size=32, bits=4)):
        assert mx.array_equal(a, b)


def test_reference_attention_equals_plain_softmax_attention():
    # Pages made from known K/V: the reference path must equal attention over the dequantized
    # tokens, with GQA and a partial last page, computed here independently in numpy.
    q, kp, vp, table, q_len, kr, vr, kw = case("affine", mx.float32, 64, 1, 3, 1, 32)
    got = np.array(mk.paged_attention(q, kp, vp, table, q_len, kr, vr, backend="reference", **kw))
    def deq(p):
        return np.array(ref.dequant_affine(*p, table, 32, 4, mx.float32))[:, :q_len]

    k = np.concatenate([deq(kp), np.array(kr)], axis=1)[0]
    v = np.concatenate([deq(vp), np.array(vr)], axis=1)[0]
    for h in range(3):
        s = np.array(q)[h, 0] @ k.T * kw["scale"]
        p = np.exp(s - s.max())
        np.testing.assert_allclose(got[h, 0], (p / p.sum()) @ v, rtol=1e-4, atol=1e-5)


def test_rotation_is_orthogonal_and_self_inverse():
    x = mx.random.normal((3, 128), key=mx.random.key(4))
    s = signs(128, 5)
    y = ref.rotate(x, s)
    np.testing.assert_allclose(np.array(ref.unrotate(y, s)), np.array(x), atol=1e-5)
    np.testing.assert_allclose(np.array(mx.linalg.norm(y, axis=-1)),
                               np.array(mx.linalg.norm(x, axis=-1)), rtol=1e-5)


def test_reference_prefill_equals_reference_attention():
    *arrays, kw = case("rotated", mx.float32, 64, 1, 3, 6, 32, recent=9)
    a = mk.prefill_attention(*arrays, backend="reference", run_pages=1, **kw)
    b = mk.paged_attention(*arrays, backend="reference", **kw)
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-5)
    assert codebook().shape == (16,)
