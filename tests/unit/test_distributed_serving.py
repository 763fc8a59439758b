"""serving.py without a launch (one rank): what travels to the followers, what is refused, and that the
Leader and its serial Engine give the Runtime's own tokens (the 2-rank runs are in test_distributed_serve)."""

import pytest

from justfit.distributed.serving import Leader, _stream_kwargs, turn_options
from justfit.errors import UserError


def test_turn_options_travel_as_json_or_are_refused():
    import json

    t = json.loads(json.dumps(turn_options(0.7, None, 0.9, {"stop": "END", "logit_bias": {5: -1.5}, "top_k": 3})))
    kw = _stream_kwargs({"op": "turn", "tokens": [1], **t})
    assert kw["stop"] == ["END"] and kw["logit_bias"] == {5: -1.5} and kw["top_k"] == 3
    assert isinstance(kw["seed"], int)  # unseeded sampling gets one seed for every rank
    assert turn_options(0.0, None, 1.0, {})["seed"] is None
    with pytest.raises(UserError, match="mlx.launch"):
        turn_options(0.0, None, 1.0, {"constraint": object()})
    with pytest.raises(UserError, match="mlx.launch"):
        turn_options(0.0, None, 1.0, {"logits_processors": [lambda t, x: x]})
    with pytest.raises(UserError, match="draft"):
        turn_options(0.0, None, 1.0, {"draft": 1})


def test_leader_and_serial_engine_give_the_runtime_s_tokens(tmp_path_factory):
    from distributed_launch import sharp_tiny_folder
    from statetrans_util import runtime, tiny_model_folder

    base = tmp_path_factory.mktemp("tiny-leader")
    rt = runtime(sharp_tiny_folder(tiny_model_folder(base, layers=2), base / "sharp"), base / "home", bits=16)
    want = [rt.generate(p, max_tokens=6).tokens for p in ("hello there", "the river bank")]
    leader = Leader(rt)
    assert leader.generate("hello there", max_tokens=6).tokens == want[0]
    reqs = [leader.submit(p, max_tokens=6) for p in ("hello there", "the river bank", "hello there")]
    reqs[2].cancel()  # queued, never started
    assert [g.tokens for g in leader.batch_engine().run(reqs[:2])] == want
    assert reqs[2].done and leader.batch_engine().report()["queued"] == 0
    first = leader.stream("hello there", max_tokens=6)
    next(first)
    with pytest.raises(RuntimeError, match="one at a time"):  # never a silent deadlock of the thread
        next(leader.stream("the river bank", max_tokens=6))
    first.close()
    assert leader.generate("the river bank", max_tokens=6).tokens == want[1]
    with pytest.raises(UserError, match="prompt_cache_key"):
        leader.session("s")
    assert leader.stop() is None
