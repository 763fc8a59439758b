"""`justfit bench scale --json` end to end on a tiny model: one JSON object, 1-rank and 2-rank rows,
KV bytes per rank halved by the 2-rank cut and capacity doubled under the same per-rank budget."""

import json
import subprocess
import sys

import pytest
from distributed_launch import env, why_not


@pytest.mark.slow
def test_bench_scale_json(tmp_path_factory):
    reason = why_not()
    if reason:
        pytest.skip(reason)
    from statetrans_util import tiny_model_folder

    folder = tiny_model_folder(tmp_path_factory.mktemp("tiny-bench"), layers=4)
    r = subprocess.run([sys.executable, "-m", "justfit", "bench", "scale", "--model", str(folder), "--rounds", "1",
                        "--tokens", "3", "--budget-mb", "1", "--json"], capture_output=True, text=True, timeout=600,
                       env=env(JUSTFIT_HOME=tmp_path_factory.mktemp("bench-home")))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["bench"] == "scale" and [row["system"] for row in out["rows"]] == ["mlx-lm-fp16", "justfit", "justfit"]
    one, two = out["rows"][1], out["rows"][2]
    assert (one["ranks"], two["ranks"], two["sharding"]) == (1, 2, "tensor")
    assert len(two["kv_bytes_per_rank"]) == 2 and all(b * 2 == one["kv_bytes"] for b in two["kv_bytes_per_rank"])
    assert two["capacity_positions"] == 2 * one["capacity_positions"]
    assert two["collective_s_per_token"] > 0 and one["collective_s_per_token"] == 0
    for row in out["rows"]:
        assert row["rounds"] == 1 and row["decode_tok_s_min"] <= row["decode_tok_s"] <= row["decode_tok_s_max"]
