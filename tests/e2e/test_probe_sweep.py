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


class PlantedBackend:
    """Returns planted latencies instead of running a model: KV-on budgets 40-55 are 6x slower."""

    name, model_id, kv_name, vocab_size = "synthetic", "planted", "fp16", 1000
    device = {"kind": "cpu", "name": "planted", "platform": "test"}

    def __init__(self):
        import numpy as np

        self.rng, self.calls = np.random.default_rng(0), []

    def versions(self):
        return {}

    def generate(self, ids, budget, kv):
        self.calls.append(budget)
        slow = 6.0 if kv and 40 <= budget < 56 else 1.0
        return 0.01 * budget * (1 if kv else 3) * slow * float(self.rng.lognormal(0, 0.03))

    def timed_steps(self, ids, budget, kv):
        return 0.01, [0.001] * (budget - 1)


def test_run_probe_refines_around_the_transitions():
    from justfit.probe.cli import run_probe

    be = PlantedBackend()
    grid = {"budgets": list(range(8, 97, 8)), "contexts": [16], "kv": ["on", "off"], "warmup": 0, "repeats": 5,
            "step_runs": 1, "seed": 1}
    rep = run_probe(be, grid, refine=True, progress=lambda *a: None)
    assert rep["grid"]["refined"] == [34, 36, 38, 40, 48, 50, 52, 54]
    bad = [r for r in rep["regimes"] if r["label"] == "anomalous"]
    assert [(r["kv"], r["onset"], r["end"], r["recovery"]) for r in bad] == [("on", 40, 54, 56)]
    assert 5 < bad[0]["spike_ratio"] < 7.5
    rows = {r["budget"]: r for r in rep["summary"] if r["kv"] == "on"}
    assert rows[40]["n"] == 10 and rows[34]["n"] == 5  # anomalous budgets were measured again
    assert rows[32]["kv_speedup"] > 2.5 and rows[48]["kv_speedup"] < 1


def test_end_to_end_sweep_on_the_default_model(runtime16, tmp_path):
    """The real default model through the runtime on a small grid: valid files, budgets in order,
    recomputing without a cache slower than decoding with one (a 48-token prompt makes every
    cache-free step a real prefill, so the gap stands out of the noise of a busy machine)."""
    import csv
    import json

    from justfit.probe.backends import RuntimeBackend
    from justfit.probe.cli import run_probe, write_outputs

    be = RuntimeBackend(runtime16, "default")
    grid = {"budgets": [4, 2], "contexts": [48], "kv": ["on", "off"], "warmup": 0, "repeats": 2, "step_runs": 1,
            "seed": 42}
    rep = run_probe(be, grid, progress=lambda *a: None)
    write_outputs(rep, tmp_path, save_map=False)
    back = report.load_report(tmp_path / "probe.json")
    assert back["backend"] == "mlx" and back["kv_config"] == "fp16" and back["versions"]["justfit"]
    assert back["grid"]["budgets"] == [2, 4]
    assert [(r["kv"], r["budget"]) for r in back["summary"]] == [("on", 2), ("on", 4), ("off", 2), ("off", 4)]
    assert len(list(csv.DictReader(open(tmp_path / "probe.csv")))) == 4
    assert (tmp_path / "probe.png").read_bytes()[:4] == b"\x89PNG"
    rows = {(r["kv"], r["budget"]): r for r in back["summary"]}
    assert rows[("off", 4)]["median_s"] > 1.3 * rows[("off", 2)]["median_s"]  # twice the prefills
    assert rows[("off", 4)]["median_s"] > 1.2 * rows[("on", 4)]["median_s"]
    assert rows[("on", 4)]["kv_speedup"] == rows[("off", 4)]["kv_speedup"] > 1.2
    assert rows[("off", 4)]["decode_step_median_s"] > 1.5 * rows[("on", 4)]["decode_step_median_s"]
    raw = {(r["kv"], r["budget"]): r for r in json.loads((tmp_path / "probe.json").read_text())["raw"]}
    assert [len(raw[("on", 4)]["step_s"][0]), len(raw[("off", 2)]["step_s"][0])] == [3, 1]


class StoppedBackend(PlantedBackend):
    """The planted backend with Ctrl-C pressed during its `stop_at`-th generate call."""

    def __init__(self, stop_at: int):
        super().__init__()
        self.stop_at = stop_at

    def generate(self, ids, budget, kv):
        if len(self.calls) + 1 == self.stop_at:
            raise KeyboardInterrupt
        return super().generate(ids, budget, kv)


def _probe(monkeypatch, tmp_path, backend, *args):
    from typer.testing import CliRunner

    import justfit.probe.backends
    from justfit.cli import app

    monkeypatch.setenv("JUSTFIT_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(justfit.probe.backends, "make_backend", lambda *a, **kw: backend)
    return CliRunner().invoke(app, ["probe", "--out", str(tmp_path / "out"), "--warmup", "0", "--repeats", "2",
                                    "--step-runs", "0", *args])


def test_ctrl_c_saves_the_cells_measured_so_far_and_says_where(monkeypatch, tmp_path):
    r = _probe(monkeypatch, tmp_path, StoppedBackend(stop_at=8), "--budgets", "8:96:8")
    assert r.exit_code == 130, r.output
    back = report.load_report(tmp_path / "out" / "probe.json")
    assert [c["budget"] for c in back["raw"]] == [8, 16, 24] and back["grid"]["interrupted"] is True
    assert f"saved the 3 cells measured so far in {tmp_path / 'out'}" in r.output
    assert "not saved as this device's map" in r.output and not (tmp_path / "home" / "probe").exists()


def test_ctrl_c_before_any_cell_writes_nothing_and_says_so(monkeypatch, tmp_path):
    r = _probe(monkeypatch, tmp_path, StoppedBackend(stop_at=1), "--budgets", "8:96:8")
    assert r.exit_code == 130 and "nothing written" in r.output
    assert not (tmp_path / "out" / "probe.json").exists()


def test_a_small_sweep_becomes_the_map_only_when_asked(monkeypatch, tmp_path):
    r = _probe(monkeypatch, tmp_path, PlantedBackend(), "--budgets", "8,16")
    assert r.exit_code == 0, r.output
    assert "not saved as this device's map" in r.output and "--save-map" in r.output
    assert not (tmp_path / "home" / "probe").exists()
    r = _probe(monkeypatch, tmp_path, PlantedBackend(), "--budgets", "8,16", "--save-map")
    assert r.exit_code == 0 and "saved map" in r.output and list((tmp_path / "home" / "probe").glob("*.json"))
    r = _probe(monkeypatch, tmp_path / "full", PlantedBackend(), "--budgets", "8:64:8")  # 8 budgets: saved unasked
    assert "saved map" in r.output, r.output


def test_the_default_sweep_is_the_quick_one():
    import inspect

    from justfit.probe.cli import probe

    defaults = {p.name: p.default for p in inspect.signature(probe).parameters.values()}
    assert [defaults[k].default for k in ("budgets", "contexts", "kv", "warmup", "repeats")] == ["16:128:16", "32", "on", 1, 3]
