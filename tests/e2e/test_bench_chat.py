"""`justfit bench chat`: rows for both systems with the fields every bench row carries."""

import json

import pytest

from justfit.bench import chat as bench_chat


def test_timed_measures_first_token_and_decode_rate():
    ttft, tps, n = bench_chat._timed(iter(range(5)))
    assert n == 5 and ttft >= 0 and tps > 0
    assert bench_chat._timed(iter([]))[2] == 0


def test_bandwidth_columns_share_of_the_limit():
    from justfit.bench import bandwidth

    got = bandwidth.columns(weights=90 << 20, kv_per_token=0, context=100, tok_s=50, bandwidth=(90 << 20) * 100)
    assert got["bandwidth_pct"] == 50.0 and got["bandwidth_limit_tok_s"] == 100.0


def test_long_prompt_is_about_the_asked_length_and_differs_by_round():
    encode = str.split  # a word a token: enough to check the length control
    a = bench_chat.long_prompt("Why?", 500, seed=0, encode=encode)
    b = bench_chat.long_prompt("Why?", 500, seed=1, encode=encode)
    doc = a.split("\n\n")[1]
    assert 450 <= len(doc.split()) <= 500 and a.endswith("Why?")
    assert a.split()[:12] != b.split()[:12]  # no shared prefix between rounds beyond the first words
    assert bench_chat.long_prompt("Why?", 0, seed=0, encode=encode) == "Why?"


def test_systems_must_include_justfit_and_be_known():
    from justfit.errors import UserError

    for bad in ("mlx-lm", "justfit,llama.cpp"):
        with pytest.raises(UserError):
            bench_chat.chat(rounds=1, max_tokens=4, model="default", context=0, systems=bad, quick=False,
                            json_out=True)


@pytest.mark.slow
def test_bench_chat_quick_on_default_model(capsys):
    bench_chat.chat(rounds=1, max_tokens=4, model="default", context=0, systems=",".join(bench_chat.SYSTEMS),
                    quick=True, json_out=True)
    out = json.loads(capsys.readouterr().out)
    rows = {r["system"]: r for r in out["rows"]}
    assert out["bench"] == "chat" and out["context"] == 0 and set(rows) == {"justfit", "mlx-lm", "mlx-lm-quantized"}
    assert rows["mlx-lm"]["weights"] == "float32" and rows["mlx-lm-quantized"]["weights"] == "as stored"
    for r in rows.values():
        assert r["bytes_per_token"] > 50 << 20 and 0 < r["bandwidth_pct"] < 200 and r["kv"]
        assert r["rounds"] == 2 and r["generated_tokens"] > 0 and r["prompt_tokens"] > 10
        assert 0 < r["ttft_s_min"] <= r["ttft_s"] <= r["ttft_s_max"]
        assert r["peak_memory_bytes"] > 100 << 20 and r["decode_tok_s"] > 0
