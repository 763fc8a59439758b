"""PhaseSwap per rank under mlx.launch: each rank has its own memory budget and its own tool phase,
which releases that rank's weights; the turns after it give the same greedy tokens as one process."""

import pytest
from distributed_launch import WORKER, last_json, launch, sharp_tiny_folder, why_not


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from statetrans_util import tiny_model_folder

    base = tmp_path_factory.mktemp("tiny-phase")
    return sharp_tiny_folder(tiny_model_folder(base, layers=4), base / "sharp")


@pytest.mark.slow  # ~60 s on 2 cores: one process, then 2 ranks tensor-parallel and pipelined
def test_tool_phase_per_rank_same_tokens(folder, tmp_path):
    reason = why_not()
    if reason:
        pytest.skip(reason)
    args = [WORKER, "toolphase", folder, tmp_path / "home", 16, 8, "hello there my friend", "256MB"]
    one = last_json(launch(1, args, timeout=120))
    before, after, later = one["tokens"]
    assert len(set(before)) > 3 and after == before and later != before  # a reference that can fail
    for extra in ({}, {"JUSTFIT_SHARDING": "pipeline"}):
        two = last_json(launch(2, args, timeout=240, **extra))
        assert two["tokens"] == one["tokens"], extra
        assert [r["tokens"] for r in two["ranks"]] == [one["tokens"]] * 2
        assert two["budget"] == 256_000_000  # each rank holds the whole budget for its own shard
        assert all(r["released"] > 0 for r in two["ranks"]), two["ranks"]
        if not extra:  # tensor parallel: every weight of the rank's shard is released in the tool phase
            assert two["resident_in_tool_phase"]["layers"] == 0
            assert all(r["released"] < one["released"] for r in two["ranks"])  # half the matrices each
