"""serving.py and mirror.py without a launch (one rank): what travels to the other ranks, what is refused,
and that an engine replaying the Leader's calls computes the same requests (the 2-rank runs are in
tests/e2e/test_distributed_serve.py)."""

import json

import pytest

from justfit.distributed.mirror import follow, from_wire, to_wire
from justfit.distributed.serving import Leader
from justfit.engine.sampling import Sampling
from justfit.errors import UserError


class Grammar:
    """A stand-in constraint: only its grammar text travels."""

    def __init__(self, grammar):
        self.grammar = grammar


def test_sampling_travels_as_json_or_is_refused():
    opts = {"temperature": 0.7, "seed": None, "stop": "END", "logit_bias": {5: -1.5}, "top_k": 3,
            "frequency_penalty": 0.5, "presence_penalty": None, "constraint": Grammar('start: "a"')}
    wire = json.loads(json.dumps(to_wire(opts, grammars=True)))
    assert isinstance(wire["seed"], int) and opts["seed"] == wire["seed"]  # rank 0 draws the seed it sends
    back = from_wire(wire, Grammar)
    assert back["stop"] == ["END"] and back["logit_bias"] == {5: -1.5} and back["top_k"] == 3
    assert back["frequency_penalty"] == 0.5 and "presence_penalty" not in back
    assert back["constraint"].grammar == 'start: "a"'
    back.pop("constraint")
    assert len(Sampling(**back).processors()) == 2  # the logit bias and the frequency penalty, rebuilt as data
    assert not Sampling(presence_penalty=0.5).plain_greedy
    assert to_wire({"temperature": 0.0}, grammars=False).get("seed") is None
    with pytest.raises(UserError, match="mlx.launch"):
        to_wire({"constraint": Grammar("x")}, grammars=False)
    with pytest.raises(UserError, match="mlx.launch"):
        to_wire({"constraint": object()}, grammars=True)
    with pytest.raises(UserError, match="mlx.launch"):
        to_wire({"logits_processors": [lambda t, x: x]}, grammars=True)
    with pytest.raises(UserError, match="draft"):
        to_wire({"draft": 1}, grammars=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from distributed_launch import sharp_tiny_folder
    from statetrans_util import tiny_model_folder

    base = tmp_path_factory.mktemp("tiny-leader")
    return sharp_tiny_folder(tiny_model_folder(base, layers=2), base / "sharp"), base


def test_an_engine_replaying_the_leader_s_calls_computes_the_same_requests(tiny):
    from statetrans_util import runtime

    folder, base = tiny
    rt = runtime(folder, base / "home0", bits=16)
    prompts = ("hello there", "the river bank", "hello there")
    want = [rt.generate(p, max_tokens=6).tokens for p in prompts[:2]]
    steps0 = rt.batch_engine().steps
    leader = Leader(rt)
    sent = []
    leader._send = sent.append  # what rank 0 would broadcast, in order
    assert leader.generate("hello there", max_tokens=6).tokens == want[0]
    reqs = [leader.submit(p, max_tokens=6, temperature=0.0, repetition_penalty=1.0) for p in prompts]
    reqs[2].cancel()  # queued, never started
    engine = leader.batch_engine()
    assert [g.tokens for g in engine.run(reqs[:2])] == want
    assert engine.report()["queued"] == 0 and engine.scheduler.chunks.rows() > 0
    ops = [m["op"] for m in sent]
    assert ops[:2] == ["submit", "step"] and ops.count("submit") == 4 and ops.count("cancel") == 1
    assert all(m["tokens"] == rt.encode(p) for m, p in zip([m for m in sent if m["op"] == "submit"][1:], prompts))

    other = runtime(folder, base / "home1", bits=16)  # a second rank's engine, replaying the calls
    replay = iter(sent + [{"op": "stop"}])
    seen = []
    real_submit = other.batch_engine().submit

    def submit(*args, **kwargs):
        seen.append(real_submit(*args, **kwargs))
        return seen[-1]

    other.engine.submit = submit
    assert follow(other.engine, lambda: next(replay)) == ops.count("step")
    assert [r.out for r in seen] == [want[0], want[0], want[1], []]
    assert seen[3].finish_reason == "cancelled" and other.engine.steps == engine.steps - steps0
    with pytest.raises(UserError, match="prompt_cache_key"):  # a turn on caller-owned caches outside a session
        engine.submit(rt.encode("hi"), 4, caches=rt.make_cache(), reused=0)


def test_a_mirrored_sessions_calls_replay_on_the_other_ranks_own_session(tiny):
    from statetrans_util import runtime

    from justfit.statetrans.manifest import read_manifest

    folder, base = tiny
    rt, other = runtime(folder, base / "lead", bits=16), runtime(folder, base / "follow", bits=16)
    leader = Leader(rt)
    sent = []
    leader._send = sent.append
    s = leader.session("notes")
    for text in ("hello there", "and the river bank?"):
        turn = s.submit(text, 6)
        leader.batch_engine().run([turn])
        leader.batch_engine().settle()  # the turn's last token into the session's caches, announced
    s.close()
    ops = [(m["op"], m.get("call")) for m in sent]
    assert ops[:3] == [("session", "open"), ("session", "submit"), ("bind", None)]
    assert ("settle", None) in ops and ops[-1] == ("session", "close")
    turns = []
    real_submit = other.batch_engine().submit

    def submit(*args, **kwargs):
        turns.append(real_submit(*args, **kwargs))
        return turns[-1]

    other.engine.submit = submit
    follow(other.engine, lambda it=iter(sent + [{"op": "stop"}]): next(it), open_session=other.session)
    assert len(turns) == 2 and all(t.given is not None for t in turns)  # on the follower's own session caches
    mine, theirs = read_manifest(rt.home, "notes"), read_manifest(other.home, "notes")
    assert theirs is not None and theirs.tokens == mine.tokens and len(mine.tokens) > 12


def test_a_rank_out_of_step_raises(tiny):
    from statetrans_util import runtime

    folder, base = tiny
    rt = runtime(folder, base / "home2", bits=16)
    msgs = iter([{"op": "submit", "id": 0, "tokens": [], "max_tokens": 4, "sampling": {}}])
    with pytest.raises(RuntimeError, match="out of step"):
        follow(rt.batch_engine(), lambda: next(msgs))
    msgs = iter([{"op": "submit", "id": 0, "tokens": rt.encode("hi"), "max_tokens": 4, "sampling": {}},
                 {"op": "step", "state": [0, 0, 0, 0]}])  # rank 0 held no request: this rank holds one
    with pytest.raises(RuntimeError, match="out of step"):
        follow(rt.batch_engine(), lambda: next(msgs))
