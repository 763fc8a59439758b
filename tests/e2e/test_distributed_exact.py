"""Two ranks (mlx.launch, ring backend, loopback) give the same greedy tokens as one process:
tensor parallel and the layer-pipeline plug-in, 16-bit and 4-bit KVExec pages; the default model
(3 KV heads, so tensor parallelism cannot split it in two) through the pipeline."""

import pytest
from distributed_launch import WORKER, last_json, launch, why_not

from justfit.distributed import choose
from justfit.distributed.pipeline import layer_range, split_layers
from justfit.errors import UserError


def _skip_without_launch():
    reason = why_not()
    if reason:
        pytest.skip(reason)


def test_choice_follows_the_heads():
    from distributed_worker import tiny_llama

    assert choose(tiny_llama(2), 2) == "tensor"
    assert choose(tiny_llama(2), 1) == "single"
    assert choose(tiny_llama(1), 2) == "pipeline"  # 1 KV head cannot be split in two
    with pytest.raises(UserError, match="KV heads do not divide by 2"):
        choose(tiny_llama(1), 2, "tensor")
    with pytest.raises(UserError, match="JUSTFIT_SHARDING"):
        choose(tiny_llama(2), 2, "diagonal")
    with pytest.raises(UserError, match="cannot fill 5 pipeline stages"):
        choose(tiny_llama(1), 5, "pipeline")


def test_layer_split_is_mlx_lm_s():
    assert split_layers(30, 2) == [15, 15] and split_layers(5, 2) == [3, 2]
    assert list(layer_range(30, 0, 2)) == list(range(15, 30))  # rank 0 runs the last layers
    assert list(layer_range(30, 1, 2)) == list(range(15))
    assert sorted(i for r in range(3) for i in layer_range(7, r, 3)) == list(range(7))


def test_tiny_llama_two_ranks_same_tokens_as_one_process():
    _skip_without_launch()
    one = last_json(launch(1, [WORKER, "raw", 2, 16, "tensor,pipeline"], timeout=120))
    two = last_json(launch(2, [WORKER, "raw", 2, 16, "tensor,pipeline"], timeout=240))
    for key in ("tensor/16", "tensor/4", "pipeline/16", "pipeline/4"):
        assert two["tokens"][key] == one["tokens"][key], key
        assert len(set(one["tokens"][key])) > 3, "the reference must not be one repeated token"
    r0, r1 = two["ranks"]
    assert r0["tokens"] == r1["tokens"]  # the follower computed the same tokens
    # KV follows the shards: tensor parallel halves the KV heads, pipeline the layers, on every rank
    for r in (r0, r1):
        assert r["sharding"]["tensor/16"]["kind"] == "tensor" and r["sharding"]["tensor/16"]["kv_heads"] == 1
        assert r["kv_bytes"]["tensor/16"] * 2 == one["ranks"][0]["kv_bytes"]["tensor/16"]
        assert r["kv_bytes"]["pipeline/16"] * 2 == one["ranks"][0]["kv_bytes"]["pipeline/16"]
    assert r0["sharding"]["pipeline/16"]["layers"] == [2, 3] and r1["sharding"]["pipeline/16"]["layers"] == [0, 1]


@pytest.mark.slow
def test_default_model_pipelines_over_two_ranks(default_model_dir, tmp_path):
    _skip_without_launch()
    args = [WORKER, "runtime", default_model_dir, tmp_path / "home", 16, 8, "What is the capital of France?"]
    one = last_json(launch(1, args, timeout=300))
    two = last_json(launch(2, args, timeout=600))
    assert two["tokens"] == one["tokens"] and len(one["tokens"]) >= 5
    assert [r["sharding"]["kind"] for r in two["ranks"]] == ["pipeline", "pipeline"]
    assert two["ranks"][0]["sharding"]["layers"] == list(range(15, 30))
