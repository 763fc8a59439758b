"""probe.json / csv / png, FORMAT.md invariants, compare, grid parsing and the CLI's user errors."""

import csv
import json
import subprocess
import sys

import pytest

from justfit.errors import UserError
from justfit.probe import report, sweep, synthetic


synthetic_report = synthetic.demo_report


def test_report_follows_format_md_and_round_trips(tmp_path):
    rep = synthetic_report(plateau=(480, 560, 6.0))
    assert report.validate(rep) is None
    path = report.write_json(rep, tmp_path / "probe.json")
    back = report.load_report(path)
    assert back["format"] == "justfit-probe" and back["version"] == 1
    assert back["grid"]["budgets"] == sorted(back["grid"]["budgets"])
    bad = [r for r in back["regimes"] if r["label"] == "anomalous"]
    assert [(r["context"], r["kv"], r["onset"], r["end"], r["recovery"]) for r in bad] == \
        [(32, "on", 480, 560, 576), (512, "on", 480, 560, 576)]
    assert back["verdict"] == {"smooth": False, "anomalous_intervals": 2, "max_spike_ratio": pytest.approx(max(r["spike_ratio"] for r in bad))}
    # intervals of one series tile its budgets without gaps or overlaps
    for ctx in (32, 512):
        for kv in ("on", "off"):
            ivs = [r for r in back["regimes"] if r["context"] == ctx and r["kv"] == kv]
            assert ivs[0]["start"] == 128 and ivs[-1]["end"] == 768
            budgets = [r["budget"] for r in report.series_rows(back, ctx, kv)]
            for a, b in zip(ivs, ivs[1:]):
                assert budgets[budgets.index(a["end"]) + 1] == b["start"] and a["label"] != b["label"]
    # the KV speedup collapses inside the anomalous band
    rows = {r["budget"]: r for r in report.series_rows(back, 32, "on")}
    assert rows[512]["kv_speedup"] < rows[464]["kv_speedup"] / 3


def test_invalid_files_are_user_errors(tmp_path):
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(UserError, match="not readable JSON"):
        report.load_report(tmp_path / "x.json")
    rep = synthetic_report(budgets=range(16, 129, 16))
    rep["version"] = 99
    (tmp_path / "y.json").write_text(json.dumps(rep))
    with pytest.raises(UserError, match="version"):
        report.load_report(tmp_path / "y.json")
    with pytest.raises(UserError, match="no such probe file"):
        report.load_report(tmp_path / "missing.json")


def test_csv_and_png(tmp_path):
    from justfit.probe.plot import plot_report

    rep = synthetic_report(plateau=(480, 560, 6.0))
    report.write_csv(rep, tmp_path / "probe.csv")
    rows = list(csv.DictReader(open(tmp_path / "probe.csv")))
    assert len(rows) == len(rep["summary"]) == 2 * 2 * 41
    assert set(rows[0]) == set(report.CSV_FIELDS)
    assert {r["label"] for r in rows} == {"normal", "anomalous"}
    png = plot_report(rep, tmp_path / "probe.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_compare_prints_both_maps_and_plots(tmp_path):
    from justfit.probe.compare import compare

    a, b = tmp_path / "a", tmp_path / "b"
    report.write_json(synthetic_report(seed=1), a / "probe.json")
    report.write_json(synthetic_report(seed=1, plateau=(400, 432, 5.0)), b / "probe.json")
    text = compare(a / "probe.json", b / "probe.json", tmp_path / "cmp")
    assert "a: no anomalous interval (smooth)" in text
    assert "b: context 32 kv on: budgets 400-432" in text
    line = next(ln for ln in text.splitlines() if ln.split()[:3] == ["32", "on", "416"])
    assert float(line.split()[5]) == pytest.approx(5.0, abs=0.01) and "normal / anomalous" in line
    assert (tmp_path / "cmp" / "compare.png").read_bytes()[:4] == b"\x89PNG"


def test_grid_parsing_and_refinement():
    assert sweep.parse_budgets("128:768:16")[:3] == [128, 144, 160] and sweep.parse_budgets("128:768:16")[-1] == 768
    assert sweep.parse_budgets("64,16,64") == [16, 64]
    assert sweep.parse_contexts("512,32") == [32, 512] and sweep.parse_kv("off,on") == ["off", "on"]
    for bad in ("128:768", "a:b:c", "0,5", "128:768:0", ""):
        with pytest.raises(UserError):
            sweep.parse_budgets(bad)
    with pytest.raises(UserError):
        sweep.parse_kv("maybe")
    regs = [{"label": "normal", "start": 128, "end": 368}, {"label": "anomalous", "start": 384, "end": 400},
            {"label": "normal", "start": 416, "end": 768}]
    new = sweep.refine_budgets(regs, range(128, 769, 16))
    assert new == [372, 376, 380, 384, 400, 404, 408, 412]


def test_merge_pools_repeats_of_a_cell():
    a = [dict(context=8, kv="on", budget=16, warmup_s=[], e2e_s=[1.0], prefill_s=[], step_s=[])]
    b = [dict(context=8, kv="on", budget=16, warmup_s=[], e2e_s=[2.0], prefill_s=[], step_s=[]),
         dict(context=8, kv="on", budget=8, warmup_s=[], e2e_s=[0.5], prefill_s=[], step_s=[])]
    merged = sweep.merge_records(a, b)
    assert [(r["budget"], r["e2e_s"]) for r in merged] == [(8, [0.5]), (16, [1.0, 2.0])]
    assert a[0]["e2e_s"] == [1.0]


def test_torch_backend_without_torch_names_the_extra(monkeypatch):
    from justfit.probe import backends

    monkeypatch.setitem(sys.modules, "torch", None)  # as if PyTorch were not installed
    with pytest.raises(UserError, match=r"pip install 'justfit\[torch\]'"):
        backends.make_backend("torch", "gpt2", "mps")
    with pytest.raises(UserError, match="backend must be one of"):
        backends.make_backend("onnx", "gpt2")


def test_cli_module_does_not_import_mlx_and_compare_runs(tmp_path):
    code = "import sys, justfit.probe.cli; assert 'mlx' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    import typer
    from typer.testing import CliRunner

    from justfit.probe.cli import probe

    app = typer.Typer()
    app.command()(probe)
    report.write_json(synthetic_report(seed=1), tmp_path / "a" / "probe.json")
    report.write_json(synthetic_report(seed=2), tmp_path / "b" / "probe.json")
    res = CliRunner().invoke(app, ["--compare", str(tmp_path / "a" / "probe.json"), str(tmp_path / "b" / "probe.json"),
                                   "--out", str(tmp_path / "c")])
    assert res.exit_code == 0, res.output
    assert "anomalous intervals:" in res.output and (tmp_path / "c" / "compare.png").exists()
    res = CliRunner().invoke(app, ["--budgets", "1:2"])
    assert isinstance(res.exception, UserError)


def test_without_matplotlib_json_and_csv_are_written_and_the_hint_given(tmp_path, monkeypatch):
    """matplotlib is the [plot] extra: without it the probe still writes its data and says how to draw."""
    import justfit.probe.plot as plot
    from justfit.probe.cli import write_outputs

    monkeypatch.setattr(plot, "have_matplotlib", lambda: False)
    text = write_outputs(synthetic_report(), tmp_path / "out", save_map=False)
    assert (tmp_path / "out" / "probe.json").is_file() and (tmp_path / "out" / "probe.csv").is_file()
    assert not (tmp_path / "out" / "probe.png").exists()
    assert "pip install 'justfit[plot]'" in text and "--plot" in text


def test_plot_from_an_existing_probe_json(tmp_path):
    from typer.testing import CliRunner

    from justfit.cli import app

    report.write_json(synthetic_report(), tmp_path / "probe.json")
    r = CliRunner().invoke(app, ["probe", "--plot", str(tmp_path / "probe.json"), "--out", str(tmp_path / "pics")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "pics" / "probe.png").read_bytes()[:4] == b"\x89PNG"


def _torch_extra_missing() -> str:
    import importlib.util

    missing = [m for m in ("torch", "transformers", "accelerate", "gguf") if importlib.util.find_spec(m) is None]
    return f"the [torch] extra is not installed (missing: {', '.join(missing)}): pip install 'justfit[torch]'" if missing else ""


@pytest.mark.skipif(bool(_torch_extra_missing()), reason=_torch_extra_missing() or "n/a")
def test_torch_backend_sweeps_a_gguf_through_transformers(tmp_path):
    """The torch backend loads a GGUF with transformers (as it does the default model) and times it."""
    from gguf_writer import write_tiny_llama_gguf

    from justfit.probe.backends import make_backend
    from justfit.probe.report import build_report
    from justfit.probe.sweep import run_sweep

    gguf = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(gguf, "F32", layers=2)
    be = make_backend("torch", str(gguf), "cpu")
    assert be.device["kind"] == "cpu" and be.versions()["torch"].startswith("2.13")
    records = run_sweep(be, [2, 4], [8], ["on", "off"], warmup=0, repeats=1)
    assert {(r["kv"], r["budget"]) for r in records} == {("on", 2), ("on", 4), ("off", 2), ("off", 4)}
    rep = build_report(be, records, {"budgets": [2, 4], "contexts": [8], "kv": ["on", "off"], "warmup": 0,
                                     "repeats": 1, "step_runs": 1, "seed": 42, "refined": []})
    assert rep["summary"] and all(r["median_s"] > 0 for r in rep["summary"])
