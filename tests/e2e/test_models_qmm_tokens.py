"""The default model on its 4-bit weights through qmm.c gives the float32 path's greedy tokens, and is the
default on the CPU where the kernel was measured faster."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

import justfit
from justfit.models import load, qlinear, qmm, tuning, weight_policy

PROMPTS = ["The three largest rivers in Europe are", "To bake bread you first", "import numpy as np\n\ndef mean(",
           "My favourite season is autumn because", "Translate to French: good morning, friend."]
STEPS = 16


def _greedy(model, tokenizer, prompt):
    ids = mx.array(tokenizer.encode(prompt))
    return [int(t) for _, (t, _) in zip(range(STEPS), generate_step(ids, model))]


@pytest.fixture(scope="module")
def models(default_model_dir):
    if qmm.library() is None:
        pytest.skip(f"qmm.c does not run here: {qmm.status()}")
    quantized, tokenizer = load(str(default_model_dir), weights="quantized")
    reference, _ = load(str(default_model_dir), weights="fp32")
    return quantized, reference, tokenizer


def test_greedy_tokens_equal_the_float32_path(models):
    quantized, reference, tokenizer = models
    assert qlinear.kernel_modules(quantized) > 0 and qlinear.kernel_modules(reference) == 0
    before = qmm.CALLS["qmm"]
    for prompt in PROMPTS:
        assert _greedy(quantized, tokenizer, prompt) == _greedy(reference, tokenizer, prompt), prompt
    assert qmm.CALLS["qmm"] > before  # the kernel ran


def test_default_on_the_cpu_follows_the_measurement(models, monkeypatch):
    quantized = models[0]
    monkeypatch.delenv("JUSTFIT_WEIGHTS", raising=False)
    expected = "quantized" if qmm.available() and tuning.choices()["quantized"] else "fp32"
    assert weight_policy(quantized) == expected
    monkeypatch.setenv("JUSTFIT_WEIGHTS", "fp32")
    assert weight_policy(quantized) == "fp32"


def test_runtime_streams_on_the_kernel(default_model_dir, tmp_path, monkeypatch):
    if qmm.library() is None:
        pytest.skip(f"qmm.c does not run here: {qmm.status()}")
    monkeypatch.setenv("JUSTFIT_WEIGHTS", "quantized")
    rt = justfit.Runtime(model=str(default_model_dir), home=tmp_path)
    before = qmm.CALLS["qmm"]
    text = "".join(c.text for c in rt.stream("Say hello.", max_tokens=8))
    assert text and qmm.CALLS["qmm"] > before
