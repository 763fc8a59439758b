"""`justfit bench batch` plumbing on a tiny random model: JSON shape, row fields, capacity arithmetic."""

import json

import mlx.core as mx
import pytest
from mlx_lm.models import llama

from justfit.bench import batch as bench_batch
from justfit.errors import UserError


@pytest.fixture()
def tiny(monkeypatch, runtime16):
    import justfit.models

    mx.random.seed(3)
    model = llama.Model(llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=96,
                                        num_attention_heads=6, num_key_value_heads=2, rms_norm_eps=1e-5,
                                        vocab_size=49152, head_dim=64, tie_word_embeddings=True))
    monkeypatch.setattr(justfit.models, "load", lambda spec: (model, runtime16.tokenizer))
    return model


def test_bench_batch_json(tiny, capsys):
    bench_batch.batch(concurrency="1,3", prompt_tokens="40", shared=256, gen=3, rounds=2, budget="64MiB",
                      capacity_tokens=1024, systems="justfit,mlx-lm-batch", model="tiny", wide=False, wide_layers=2,
                      json_out=True)
    out = json.loads(capsys.readouterr().out)
    assert out["bench"] == "batch" and set(out["versions"]) == {"justfit", "mlx", "mlx_lm"}
    timing = [r for r in out["rows"] if "throughput_tok_s" in r]
    assert {(r["system"], r["concurrency"]) for r in timing} == {(s, c) for s in bench_batch.SYSTEMS for c in (1, 3)}
    for r in timing:
        assert r["rounds"] == 2 and r["throughput_tok_s"] > 0 and r["peak_memory_bytes"] > r["peak_over_start_bytes"] > 0
        assert r["throughput_tok_s_min"] <= r["throughput_tok_s"] <= r["throughput_tok_s_max"]
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] and 0 < r["itl_p50_s"] <= r["itl_p99_s"]
    j3 = next(r for r in timing if r["system"] == "justfit" and r["concurrency"] == 3)
    assert j3["prefilled_tokens"] == 3 * 40  # no full page shared at this size: everything prefilled
    _check_capacity(out)


def _check_capacity(out):
    cap = {(r["system"], r["shared_prefix_tokens"]): r for r in out["rows"] if "capacity_positions" in r}
    assert set(cap) == {(s, p) for s in bench_batch.SYSTEMS for p in (0, 256)}  # one 256-token page shared
    assert cap["justfit", 0]["capacity_positions"] > cap["mlx-lm-batch", 0]["capacity_positions"] > 0
    assert cap["justfit", 256]["concurrency"] > cap["justfit", 0]["concurrency"]  # the prefix's pages held once
    assert cap["mlx-lm-batch", 256]["concurrency"] == cap["mlx-lm-batch", 0]["concurrency"]  # a cache per row
    predicted, measured = (int(out["notes"]["capacity"].split(w)[1].split(",")[0].split()[0])
                           for w in ("predicted ", "measured "))
    assert predicted == measured  # the admission arithmetic is the pool's real size, shared pages counted once


def test_bench_batch_rounds_0_gives_the_capacity_rows_only(tiny, capsys):
    bench_batch.batch(concurrency="4", prompt_tokens="40", shared=256, gen=3, rounds=0, budget="64MiB",
                      capacity_tokens=1024, systems="justfit,mlx-lm-batch", model="tiny", wide=False, wide_layers=2,
                      json_out=True)
    out = json.loads(capsys.readouterr().out)
    assert all("capacity_positions" in r for r in out["rows"])
    _check_capacity(out)


def test_bench_batch_refuses_bad_options():
    with pytest.raises(UserError):
        bench_batch.batch(concurrency="0", prompt_tokens="40", shared=20, gen=3, rounds=1, budget="64MiB",
                          capacity_tokens=1024, systems="justfit", model="tiny", wide=False, wide_layers=2,
                          json_out=True)
    with pytest.raises(UserError):
        bench_batch.batch(concurrency="2", prompt_tokens="40,x", shared=40, gen=3, rounds=1, budget="64MiB",
                          capacity_tokens=1024, systems="justfit", model="tiny", wide=False, wide_layers=2,
                          json_out=True)


def test_wide_model_has_8b_attention_shapes():
    m = bench_batch.wide_model(2, 49152)  # weights are lazy: nothing of the 8B-wide layers is computed here
    a = m.args
    assert (a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim) == (4096, 32, 8, 128)
    assert len(m.layers) == 2 and m.layers[0].self_attn.k_proj.weight.shape == (1024, 4096)
