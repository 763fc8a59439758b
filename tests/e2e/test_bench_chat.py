"""`justfit bench chat`: rows for both systems with the fields every bench row carries."""

import json

import pytest

from justfit.bench import chat as bench_chat


def test_timed_measures_first_token_and_decode_rate():
    ttft, tps, n = bench_chat._timed(iter(range(5)))
    assert n == 5 and ttft >= 0 and tps > 0
    assert bench_chat._timed(iter([]))[2] == 0


@pytest.mark.slow
def test_bench_chat_quick_on_default_model(capsys):
    bench_chat.chat(rounds=1, max_tokens=4, model="default", quick=True, json_out=True)
    out = json.loads(capsys.readouterr().out)
    rows = {r["system"]: r for r in out["rows"]}
    assert out["bench"] == "chat" and set(rows) == {"justfit", "mlx-lm"}
    for r in rows.values():
        assert r["rounds"] == 2 and r["generated_tokens"] > 0 and r["prompt_tokens"] > 10
        assert 0 < r["ttft_s_min"] <= r["ttft_s"] <= r["ttft_s_max"]
        assert r["peak_memory_bytes"] > 100 << 20 and r["decode_tok_s"] > 0
