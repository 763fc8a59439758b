"""Sweeps on a tiny random-weight mlx-lm model: record shapes, cache-free decoding, the whole command path."""

import pytest

mx = pytest.importorskip("mlx.core")

from justfit.probe import report, sweep  # noqa: E402
from justfit.probe.backends import MLXBackend  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
                           head_dim=16, tie_word_embeddings=True)
    mx.random.seed(0)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return MLXBackend(model, None, "tiny")


def test_cache_free_decoding_produces_the_cached_tokens(tiny):
    from mlx_lm.generate import generate_step

    from justfit.probe.backends import prompt_ids

    ids = prompt_ids(12, tiny.vocab_size, 42)
    cached = [t for t, _ in generate_step(mx.array(ids), tiny.model, max_tokens=10)]
    tokens = mx.array(ids)
    for _ in range(10):
        tokens = tiny._recompute_step(tokens)
    assert tokens.tolist()[12:] == cached


def test_sweep_records_and_report(tiny, tmp_path):
    from justfit.probe.cli import write_outputs

    calls = []
    recs = sweep.run_sweep(tiny, [4, 8], [8, 16], ["on", "off"], warmup=1, repeats=2, seed=3, step_runs=1,
                           progress=lambda done, total, label: calls.append((done, total)))
    assert len(recs) == 2 * 2 * 2 and calls[-1] == (32, 32) and len(calls) == 32
    for r in recs:
        assert len(r["warmup_s"]) == 1 and len(r["e2e_s"]) == 2 and len(r["prefill_s"]) == 1
        assert len(r["step_s"][0]) == r["budget"] - 1 and min(r["e2e_s"]) > 0
    rep = report.build_report(tiny, recs, {"contexts": [8, 16], "kv": ["on", "off"], "warmup": 1, "repeats": 2,
                                           "step_runs": 1, "seed": 3})
    assert report.validate(rep) is None and rep["backend"] == "mlx-lm" and rep["device"]["kind"] == "cpu"
    assert "mlx" in rep["versions"] and rep["grid"]["budgets"] == [4, 8]
    text = write_outputs(rep, tmp_path / "out", save_map=False)
    assert "verdict:" in text and sorted(p.name for p in (tmp_path / "out").iterdir()) == ["probe.csv", "probe.json", "probe.png"]


def test_bad_sweep_arguments_are_user_errors(tiny):
    from justfit.errors import UserError

    with pytest.raises(UserError):
        sweep.run_sweep(tiny, [4], [8], ["on"], repeats=0)
    from justfit.probe.backends import make_backend

    with pytest.raises(UserError, match="MLX devices are cpu or gpu"):
        make_backend("mlx-lm", "default", "mps")
