"""`justfit bench kv` plumbing on a tiny random model: row fields, JSON shape, quality metrics."""

import json

import mlx.core as mx
import pytest
from mlx_lm.models import llama

import justfit
from justfit.bench import kv as bench_kv
from justfit.bench import kv_quality


def _tiny():
    mx.random.seed(3)
    return llama.Model(llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=3, intermediate_size=96,
                                       num_attention_heads=6, num_key_value_heads=2, rms_norm_eps=1e-5,
                                       vocab_size=50000, head_dim=64, tie_word_embeddings=True))


SYSTEMS = ("justfit-default", "justfit-fp16", "mlx-lm-fp16")  # 4-bit pages, 16-bit pages, the baseline


def test_bench_json_rows(monkeypatch, capsys):
    model = _tiny()
    monkeypatch.setattr(justfit, "load", lambda spec: (model, None), raising=False)
    bench_kv.kv(contexts="300", rounds=3, steps=2, full_prefill_max=128, prefill_layers=1, budgets="256M",
                prompts=0, tokens=4, stress_page=0, document=False, systems=",".join(SYSTEMS),
                capacity_probe="2048,4096", chat=True, model="tiny", quick=False, json_out=True,
                document_file=None, document_tokens=2048)
    out = json.loads(capsys.readouterr().out)
    assert out["bench"] == "kv" and set(out["versions"]) == {"justfit", "mlx", "mlx_lm"}
    assert out["default_system"] == "justfit-default" and out["rounds"] == 3
    decode = {r["system"]: r for r in out["rows"] if r["kind"] == "decode"}
    prefill = {r["system"]: r for r in out["rows"] if r["kind"] == "prefill"}
    capacity = {r["system"]: r for r in out["rows"] if r["kind"] == "capacity"}
    assert set(decode) == set(prefill) == set(SYSTEMS) and set(capacity) == set(SYSTEMS) | {"mlx-lm-16bit"}
    for r in decode.values():
        assert r["context"] == 300 and r["rounds"] == 3
        assert 0 < r["decode_tok_s_min"] <= r["decode_tok_s"] <= r["decode_tok_s_max"]
        assert r["bytes_per_token"] > r["kv_bytes"] and 0 < r["bandwidth_pct"] and r["stream_bandwidth_bytes_s"] > 0
    sixteen, fp = capacity["mlx-lm-16bit"], capacity["mlx-lm-fp16"]  # the model computes in float32 here
    assert sixteen["kv_bytes_per_position"] * 2 == fp["kv_bytes_per_position"]
    assert fp["capacity_positions"] < sixteen["capacity_positions"] < 2 * fp["capacity_positions"] + 2
    for r in prefill.values():
        assert r["prefill_layers"] == 1 and r["peak_memory_bytes"] > 0  # 300 > full_prefill_max: cut model
        assert 0 < r["prefill_tok_s_min"] <= r["prefill_tok_s"] <= r["prefill_tok_s_max"]
    assert decode["justfit-fp16"]["kv_bytes"] == 3 * 2 * 2 * (2 * 256) * 64 * 4  # two pages per layer, float32
    for r in capacity.values():
        assert r["budget_bytes"] == 256 << 20 and 0 < r["capacity_positions"] <= r["kv_only_positions"]
    assert capacity["justfit-default"]["capacity_positions"] > 2 * capacity["mlx-lm-fp16"]["capacity_positions"]
    assert model.layers and len(model.model.layers) == 3  # the prefill cut was undone


def test_bench_rejects_bad_options(tmp_path):
    from justfit.errors import UserError

    for bad in (tmp_path / "missing.txt", tmp_path):  # no such file; a folder
        with pytest.raises(UserError, match="--document-file"):
            bench_kv.kv(contexts="", rounds=1, steps=1, full_prefill_max=1, prefill_layers=1, budgets="", prompts=0,
                        tokens=1, stress_page=0, document=True, systems="justfit-default", capacity_probe="1,2",
                        chat=False, model="x", quick=False, json_out=True, document_file=bad, document_tokens=2048)

    with pytest.raises(UserError):
        bench_kv.kv(contexts="0", rounds=1, steps=1, full_prefill_max=1, prefill_layers=1, budgets="", prompts=0,
                    tokens=1, stress_page=0, document=False, systems="justfit-default", capacity_probe="1,2", chat=True, model="x", quick=False,
                    json_out=True, document_file=None, document_tokens=2048)
    with pytest.raises(UserError):
        bench_kv.kv(contexts="128", rounds=1, steps=1, full_prefill_max=1, prefill_layers=1, budgets="", prompts=0,
                    tokens=1, stress_page=0, document=False, systems="nope", capacity_probe="1,2", chat=True, model="x", quick=False,
                    json_out=True, document_file=None, document_tokens=2048)


def test_document_rows_see_sealed_pages():
    model = _tiny()
    ids = [(11 * i + 5) % 50000 for i in range(kv_quality.DOC_SCORED_FROM + 200)]
    systems = [("justfit-fp16", (256, 256), bench_kv._factory("justfit-fp16", model)),
               ("justfit-default", (256, 256), bench_kv._factory("justfit-default", model))]
    fp, q = kv_quality.document_rows(model, ids, systems)
    assert fp["kl"] < 1e-6 and fp["top1"] == 1.0 and fp["quantized_token_fraction"] == 0.0
    assert q["quantized_token_fraction"] > 0.3 and q["kl"] > fp["kl"]  # 4-bit pages were sealed and read
    assert fp["quantized_read_fraction"] == 0.0 and 0 < q["quantized_read_fraction"] < 0.5


def test_quality_metrics_detect_divergence():
    ref = mx.array([[5.0, 0.0, 0.0], [0.0, 5.0, 0.0], [0.0, 0.0, 5.0]])
    same = kv_quality.metrics(ref, ref, [0, 1, 2])
    assert same["top1"] == 1.0 and abs(same["kl"]) < 1e-6 and same["agreement"] == 1.0
    other = mx.array([[5.0, 0.0, 0.0], [5.0, 0.0, 0.0], [0.0, 0.0, 5.0]])
    m = kv_quality.metrics(ref, other, [0, 1, 2])
    assert m["top1"] == pytest.approx(2 / 3) and m["agreement"] == pytest.approx(1 / 3) and m["kl"] > 1.0


def test_quality_rows_replay_through_caches():
    model = _tiny()
    ids, traj = [1, 2, 3, 4, 5], [7, 8, 9, 10]
    from mlx_lm.models.cache import make_prompt_cache

    ref = kv_quality._step_logits(model, make_prompt_cache(model), ids, traj)
    systems = [("mlx-lm-fp16", None, None), ("justfit-fp16", (32, 0), bench_kv._factory("justfit-fp16", model, 32)),
               ("justfit-q4-rotated", (32, 32), bench_kv._factory("justfit-q4-rotated", model, 32, 32))]
    rows = kv_quality.quality_rows(model, [(ids, traj, ref)], systems)
    assert rows[1]["kl"] < 1e-6 and rows[1]["ppl"] == pytest.approx(rows[1]["ppl_fp16"], rel=1e-4)
    assert rows[2]["quantized_token_fraction"] == 0.0  # 8 tokens never fill a 32-token page
    assert rows[2]["quantized_kv_start"] == 32 and rows[2]["page_size"] == 32


def test_capacity_arithmetic_interpolates_a_growing_workspace():
    """A workspace that grows between the probes costs its line from the first probe on (not the larger probe
    everywhere, which left mlx-lm 0 positions under 256 MiB); a bounded one costs its larger probe."""
    kv = bench_kv._kv_need(2, 10.0, 100.0)  # 2 layers x (10 B per position + 100 B fixed)
    grow = bench_kv._with_workspace(kv, [1000, 2000], (100, 200))  # +10 B per position between the probes
    assert grow(50) == kv(50) + 1000 and grow(150) == kv(150) + 1500 and grow(300) == kv(300) + 3000
    flat = bench_kv._with_workspace(kv, [1000, 900], (100, 200))
    assert flat(50) == flat(0) + 1000 == kv(0) + 2000
    assert bench_kv._longest(kv, kv(1234)) == 1234 and bench_kv._longest(kv, 199) == 0


def test_capacity_below_the_probes_is_searched_on_measured_workspaces():
    model = _tiny()
    probe = (1024, 2048)
    wide = bench_kv.capacity_rows(model, ["mlx-lm-fp16"], [1 << 40], probe)[0]  # then its derived 16-bit row
    assert not wide["workspace_measured_in_search"]
    budget = wide["workspace_bytes_at_probe"][0] // 2  # less than the first probe's workspace alone
    row, sixteen = bench_kv.capacity_rows(model, ["mlx-lm-fp16"], [budget], probe)
    n = row["capacity_positions"]
    assert sixteen["workspace_measured_in_search"] and n <= sixteen["capacity_positions"] < probe[0]
    assert row["workspace_measured_in_search"] and 0 < n < probe[0]
    make = bench_kv._factory("mlx-lm-fp16", model)
    kv = lambda m: wide["kv_bytes_per_position"] * m + wide["kv_fixed_bytes"]  # noqa: E731
    with bench_kv._Cut(model, 1):  # a re-measured peak may differ by a few KB (allocator): 1% slack
        assert kv(n) + bench_kv._workspace(model, make, n) <= 1.01 * budget
        more = n + n // 8  # allocator rounding makes single positions non-monotonic; an eighth more does not fit
        assert kv(more) + bench_kv._workspace(model, make, more) > budget
