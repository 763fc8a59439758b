"""qmm.c (quantized linear layers on the CPU) equals dequantize-then-matmul; qlinear.py runs mlx-lm's quantized
modules through it (q/k/v and gate/up in one call each); tuning.py measures once and caches."""

import platform

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from justfit.models import qlinear, qmm, tuning


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("JUSTFIT_HOME", str(tmp_path))
    monkeypatch.delenv("JUSTFIT_CPU_KERNELS", raising=False)
    tuning.reset()
    yield
    tuning.reset()


def _needs_kernel():
    if not qmm.runnable_variants():
        pytest.skip("qmm.c has no variant for this CPU (needs x86-64 AVX2+FMA or arm64)")
    if qmm.library() is None:
        pytest.skip(f"qmm.c could not be built here: {qmm.status()}")


def _reference(x, w, s, b, gs, bits):
    return x @ mx.dequantize(w, s, b, group_size=gs, bits=bits).T


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_kernel_equals_dequantized_matmul(bits, gs):
    _needs_kernel()
    mx.random.seed(bits * 1000 + gs)
    K = 3 * 128 + 2 * gs if gs != 128 else 640  # not a multiple of a 512-bit vector block: the tail path runs
    for n in (1, 7, 37, 193):
        w, s, b = mx.quantize(mx.random.normal((n, K)), group_size=gs, bits=bits)
        for rows in (1, 2, 3, 4, 5, 8, 13, 16, 37, 64):
            x = mx.random.normal((rows, K))
            ref = _reference(x, w, s, b, gs, bits)
            for v in qmm.runnable_variants():
                for threads in (1, 2, 3):
                    before = qmm.CALLS["qmm"]
                    got = qmm.matmul(x, [(w, s, b, gs, bits)], v, threads)[0]
                    assert qmm.CALLS["qmm"] == before + 1  # the kernel ran
                    err = float(mx.max(mx.abs(got - ref))) / (float(mx.max(mx.abs(ref))) + 1e-6)
                    assert err < 1e-5, (bits, gs, n, rows, v, threads, err)


def test_one_call_serves_several_weights_and_a_batch_shape():
    _needs_kernel()
    mx.random.seed(1)
    K = 192
    weights = [(*mx.quantize(mx.random.normal((n, K)), group_size=64, bits=4), 64, 4) for n in (40, 8, 24)]
    x = mx.random.normal((2, 3, K))
    outs = qmm.matmul(x, weights, qmm.runnable_variants()[0], 2)
    for (w, s, b, gs, bits), y in zip(weights, outs):
        assert y.shape == (2, 3, w.shape[0])
        assert np.allclose(np.array(y), np.array(_reference(x, w, s, b, gs, bits)), atol=1e-4)


def test_takes_refuses_what_the_kernel_does_not_compute():
    w, s, b = mx.quantize(mx.random.normal((8, 64)), group_size=64, bits=4)
    ok = [(w, s, b, 64, 4)]
    assert qmm.takes(mx.zeros((64, 64)), ok)
    assert not qmm.takes(mx.zeros((65, 64)), ok)  # prefill-sized: BLAS
    assert not qmm.takes(mx.zeros((17, 64)), ok, max_rows=16)  # past the measured crossover
    assert not qmm.takes(mx.zeros((1, 64), dtype=mx.float16), ok)
    assert not qmm.takes(mx.zeros((1, 64)), [(w, s.astype(mx.float16), b, 64, 4)])


@pytest.mark.skipif(platform.machine().lower() in ("arm64", "aarch64"), reason="runs on arm64 (the NEON test below)")
def test_neon_variant_is_not_offered_off_arm64():
    assert qmm.NEON not in qmm.runnable_variants()


@pytest.mark.skipif(platform.machine().lower() not in ("arm64", "aarch64"),
                    reason="the NEON path is compiled only on arm64; this machine cannot run it")
def test_neon_equals_dequantized_matmul():
    _needs_kernel()
    w, s, b = mx.quantize(mx.random.normal((37, 256)), group_size=32, bits=4)
    x = mx.random.normal((5, 256))
    got = qmm.matmul(x, [(w, s, b, 32, 4)], qmm.NEON, 2)[0]
    assert np.allclose(np.array(got), np.array(_reference(x, w, s, b, 32, 4)), atol=1e-4)


def _tiny_quantized():
    from mlx_lm.models import llama

    mx.random.seed(5)
    model = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=320, tie_word_embeddings=True))
    nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("tokens", [3, 80])  # decode-sized (the kernel) and prefill-sized (dequantize + BLAS)
def test_swapped_model_equals_mlx_quantized_model(tokens):
    _needs_kernel()
    model = _tiny_quantized()
    ids = mx.array([[(7 * i + 3) % 320 for i in range(tokens)]])
    ref = model(ids)
    n = qlinear.use_kernel(model)
    assert n == 2 * 7 + 1  # seven linears a layer and the tied embedding's head
    assert isinstance(model.layers[0].self_attn.q_proj, qlinear.KernelQuantizedLinear)
    tuning.choices()  # measured first: its timings call the kernel too
    before = qmm.CALLS["qmm"]
    got = model(ids)
    calls = qmm.CALLS["qmm"] - before
    assert calls == (2 * 4 + 1 if tokens <= tuning.choices()["kernel_rows"] else 0)  # q/k/v, o, gate/up, down per layer + head
    assert float(mx.max(mx.abs(got - ref))) < 1e-3
    assert qlinear.standard(model) == n and qlinear.kernel_modules(model) == 0
    assert type(model.layers[0].self_attn.q_proj) is nn.QuantizedLinear


def test_switched_off_runs_mlx_ops(monkeypatch):
    _needs_kernel()
    model = _tiny_quantized()
    qlinear.use_kernel(model)
    monkeypatch.setenv("JUSTFIT_CPU_KERNELS", "0")
    before = qmm.CALLS["qmm"]
    model(mx.array([[1, 2, 3]]))
    assert qmm.CALLS["qmm"] == before


def test_tuning_is_measured_once_and_cached(tmp_path):
    c = tuning.choices()
    p = tuning.path()
    assert p.exists() and str(p).startswith(str(tmp_path))
    assert c["key"] == tuning.cache_key()
    assert c["measured_s"] < 20  # about 0.4 s on a quiet 2-core machine; a loaded one may take many times that
    if qmm.library() is not None:
        assert c["variant"] in qmm.runnable_variants() and c["threads"] >= 1
    tuning.reset()
    again = tuning.choices()
    assert again == c  # read back, not measured again
    assert "measured in" in tuning.describe()


def test_info_shows_the_measured_choices(tmp_path):
    from typer.testing import CliRunner

    from justfit.cli import app

    r = CliRunner().invoke(app, ["info"], env={"JUSTFIT_HOME": str(tmp_path)})
    assert r.exit_code == 0, r.output
    if mx.default_device() == mx.cpu:
        assert "cpu tuning" in r.output and str(tmp_path / "tuning") in r.output.replace("\n", "")


def test_prepared_pointers_follow_the_arrays_not_their_ids():
    """A weight list's job rows are kept between calls, but only while its very arrays live: new weights
    (whose ids Python may hand out again) are never computed through an old array's pointers, and the
    kept rows hold no reference that would stop a PhaseSwap release from freeing the weights."""
    import gc
    import weakref

    _needs_kernel()
    x = mx.random.normal((1, 256))
    for seed in range(12):
        mx.random.seed(seed)
        w, s, b = mx.quantize(mx.random.normal((96, 256)), group_size=64, bits=4)
        mx.eval(w, s, b)
        for _ in range(2):  # the second call takes the kept rows
            (y,) = qmm.matmul(x, [(w, s, b, 64, 4)], qmm.runnable_variants()[0], 1)
            assert mx.allclose(y, _reference(x, w, s, b, 64, 4), atol=1e-3, rtol=1e-3)
        gone = weakref.ref(w)
        del w, s, b
        gc.collect()
        assert gone() is None  # nothing in qmm keeps the weights alive
