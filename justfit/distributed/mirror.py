"""The one engine core on every rank under mlx.launch: rank 0 leads it, the other ranks replay its calls.

Every rank runs the same Engine (justfit/engine) over its own shard. On rank 0, each call into the engine
from outside (submit, cancel, step) is first broadcast as JSON (`post`: rank 0 does not wait for it, so its
queued next pass still overlaps); the other ranks make the same call on their own engine in the same order
(`follow`), so every model pass, and every collective inside it, lines up.
A submission travels as its prompt ids, max_tokens and sampling options, grammar text and penalties
included; a seed is drawn on rank 0 when sampling is unseeded.

Inside a step the engine decides from state every rank holds alike (the queue, the running set, the
prefix index), except three things each rank would answer on its own: whether bytes fit the KV budget
(each rank counts its own shard's bytes), how many prefill rows a decoding step carries (sized from step
times each rank measures) and the tokens (a shard's logits could differ in their last bits). The engine
asks its consensus (engine/consensus.py) at those points; `Peer` answers with rank 0's value on every
rank: an `all_sum` of a value that is zero everywhere but on rank 0. `Lead` (rank 0) also announces the
engine's outside calls.
Greedy tokens agree inside the step's own graph, so the next pass can still be queued before they are read.

Sessions: rank 0's front holds a `MirroredSession` (distributed/mirrored_session.py) whose calls are
announced as session calls; each rank runs the same call on its own session, whose turn then submits to its
own engine (announced only as a `bind` of rank 0's request id). `settle`, which feeds finished turns into
their sessions' caches, is announced like a step. Not mirrored: turns on other caller-owned caches and custom
logits processors (code does not travel); both are refused on rank 0 in one line.
"""

import json
import random
from contextlib import contextmanager
from typing import Callable, Dict, Optional

from ..errors import UserError
from .world import World

# Sampling options that travel as JSON as they are (logit_bias as pairs, constraint as its grammar text).
TRAVELS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
           "frequency_penalty", "seed", "stop", "logit_bias")
CALLER_CACHES = ("turns on caller-owned caches (prompt_cache_key sessions) are not mirrored under mlx.launch yet; "
                 "leave the session out (prefix reuse still works) or serve on one rank")


class OutOfStep(RuntimeError):
    """This rank's engine no longer matches rank 0's: its next pass would not line up."""


def agree_int(value: int, w: World) -> int:
    """Rank 0's int on every rank (one all_sum; others pass anything)."""
    import mlx.core as mx

    mine = int(value) if w.is_front else 0
    return int(mx.distributed.all_sum(mx.array([mine], dtype=mx.int64), group=w.group).item())


def agree_array(a, w: World):
    """Rank 0's int array on every rank, lazily (a collective in the graph that reads it)."""
    import mlx.core as mx

    a = a.astype(mx.int32)
    return mx.distributed.all_sum(a if w.is_front else mx.zeros_like(a), group=w.group)


def post(msg: dict, w: World) -> tuple:
    """Rank 0: broadcast `msg` as JSON without waiting for it (its length, then its bytes: two all_sums that
    the other ranks read in `receive`), so rank 0 goes on building its next step meanwhile. Returns the
    arrays in flight (keep them until evaluated)."""
    import mlx.core as mx

    data = json.dumps(msg).encode()
    size = mx.distributed.all_sum(mx.array([len(data)], dtype=mx.int32), group=w.group)
    mx.async_eval(size)  # one evaluation each: their order is then the receivers' order
    body = mx.distributed.all_sum(mx.array(list(data), dtype=mx.int32), group=w.group)
    mx.async_eval(body)
    return size, body


def receive(w: World) -> dict:
    """Ranks > 0: the message rank 0 `post`ed."""
    import mlx.core as mx
    import numpy as np

    n = mx.distributed.all_sum(mx.zeros((1,), dtype=mx.int32), group=w.group).item()
    body = mx.distributed.all_sum(mx.zeros((n,), dtype=mx.int32), group=w.group)
    return json.loads(np.array(body).astype(np.uint8).tobytes().decode())


def to_wire(options: dict, grammars: bool) -> dict:
    """A submission's sampling options as JSON (a UserError for those that cannot travel). Unseeded
    sampling gets a seed here, written back into `options` so rank 0 draws the same tokens."""
    opts = {k: v for k, v in options.items() if v is not None}
    if opts.pop("logits_processors", None):
        raise UserError("custom logits processors cannot be mirrored to the other ranks under mlx.launch; "
                        "use the sampling options (penalties, logit_bias, grammars) or serve on one rank")
    constraint = opts.pop("constraint", None)
    grammar = getattr(constraint, "grammar", None)
    if constraint is not None and (grammar is None or not grammars):
        raise UserError("this grammar constraint cannot be mirrored to the other ranks under mlx.launch")
    unknown = sorted(k for k in opts if k not in TRAVELS)
    if unknown:
        raise UserError(f"option(s) {', '.join(unknown)} cannot be mirrored to the other ranks under mlx.launch")
    if opts.get("temperature", 0) > 0 and opts.get("seed") is None:  # every rank draws the same tokens
        opts["seed"] = options["seed"] = random.SystemRandom().randrange(1 << 62)
    if "logit_bias" in opts:  # JSON object keys are strings: send pairs
        opts["logit_bias"] = [[int(k), float(v)] for k, v in opts["logit_bias"].items()]
    if isinstance(opts.get("stop"), str):
        opts["stop"] = [opts["stop"]]
    if grammar is not None:
        opts["grammar"] = grammar
    return opts


def from_wire(wire: dict, make_constraint: Optional[Callable[[str], object]]) -> dict:
    """Engine.submit options from `to_wire`'s JSON."""
    opts = dict(wire)
    if "logit_bias" in opts:
        opts["logit_bias"] = {int(k): float(v) for k, v in opts["logit_bias"]}
    grammar = opts.pop("grammar", None)
    if grammar is not None:
        opts["constraint"] = make_constraint(grammar)
    return opts


class Peer:
    """The engine's consensus on a rank of an mlx.launch world (engine/consensus.py): its per-rank answers
    (the KV budget test, a step's prefill rows, the tokens) become rank 0's on every rank. Ranks > 0 use it
    as is; rank 0 uses `Lead`, which also announces the engine's outside calls."""

    def __init__(self, w: World):
        self.world = w

    def submitting(self, options: dict, caches, sampling) -> Optional[dict]:
        return None

    def submitted(self, request, announced: Optional[dict]):
        pass

    def cancelling(self, request):
        pass

    def stepping(self, engine):
        pass

    def settling(self, engine):
        pass

    def failed(self, error: BaseException):
        pass

    def agree(self, value: int) -> int:
        return agree_int(value, self.world) if self.world.size > 1 else value

    def agree_tokens(self, greedy):
        return agree_array(greedy, self.world) if self.world.size > 1 else greedy


class Lead(Peer):
    """Rank 0's consensus: before the engine runs a call from outside (submit, cancel, step) it is
    broadcast with `send(msg)`, in the engine's own order (the engine holds its lock around both), so every
    caller (a front, a Request being iterated, the engine's own `run`) is mirrored. `grammars`: can the
    other ranks build grammar constraints; `on_failure(e)` sees what a step raised (a lost rank)."""

    def __init__(self, w: World, send: Callable[[dict], None], grammars: bool = False,
                 on_failure: Optional[Callable[[BaseException], None]] = None):
        super().__init__(w)
        self.send, self.grammars, self.on_failure = send, grammars, on_failure
        self.quiet = False  # a mirrored session's turn is being submitted: announced already, as a session call

    @contextmanager
    def session_turn(self):
        """While a mirrored session submits its turn (the other ranks make the same session call), the
        engine submission inside it is neither refused for its caller-owned caches nor announced again."""
        self.quiet = True
        try:
            yield
        finally:
            self.quiet = False

    def submitting(self, options: dict, caches, sampling) -> Optional[dict]:
        """Refuse what cannot travel before anything is queued; unseeded sampling gets rank 0's seed."""
        if self.quiet:
            return None
        if caches is not None or sampling is not None:
            raise UserError(CALLER_CACHES)
        return to_wire(options, self.grammars)

    def submitted(self, request, announced: Optional[dict]):
        if self.quiet:
            self.send({"op": "bind", "id": request.id})  # the session turn the other ranks just submitted
            return
        self.send({"op": "submit", "id": request.id, "tokens": list(request.prompt),
                   "max_tokens": request.max_tokens, "sampling": announced or {}})

    def settling(self, engine):
        self.send({"op": "settle"})

    def cancelling(self, request):
        self.send({"op": "cancel", "id": request.id})

    def stepping(self, engine):
        self.send({"op": "step", "state": state(engine)})

    def failed(self, error: BaseException):
        if self.on_failure is not None:
            self.on_failure(error)


def state(engine) -> list:
    """What must be equal on every rank before a step: queued and running requests, rows computed and rows
    to hold (a rank whose prefix reuse differed from rank 0's would plan other passes)."""
    s = engine.scheduler
    live = list(s.queue) + list(s.running)
    return [len(s.queue), len(s.running), sum(r.cached for r in live), sum(len(r.feed) for r in live)]


def follow(engine, receive: Callable[[], dict], make_constraint: Optional[Callable[[str], object]] = None,
           open_session: Optional[Callable] = None) -> int:
    """Ranks > 0: make rank 0's engine calls on this rank's engine until it says stop; returns the steps run.
    A submission this rank refuses where rank 0 accepted it, or an engine state other than rank 0's before a
    step, means the ranks are out of step: raised (this rank exits, and rank 0 stops serving) rather than
    running passes whose collectives no longer match. Session calls go to this rank's own sessions (opened
    with `open_session(name, **options)`, each over this rank's shard of the pages)."""
    requests: Dict[int, object] = {}  # rank 0's request id -> this rank's request
    sessions = Sessions(open_session, make_constraint)
    steps = 0
    while True:
        msg = receive()
        op = msg["op"]
        if op == "stop":
            return steps
        if op == "step":
            if msg.get("state") is not None and msg["state"] != state(engine):
                raise OutOfStep(f"this rank's engine holds {state(engine)} (queued, running, rows computed, rows "
                                   f"in all) where rank 0's holds {msg['state']}: the ranks are out of step")
            engine.step()
            steps += 1
            for rid in [rid for rid, r in requests.items() if r.done]:
                del requests[rid]  # finished on every rank: rank 0 sends nothing more about it
        elif op == "submit":
            try:
                requests[msg["id"]] = engine.submit(msg["tokens"], msg["max_tokens"],
                                                    **from_wire(msg["sampling"], make_constraint))
            except (UserError, ValueError) as e:
                raise OutOfStep(f"this rank refused a request rank 0 accepted ({e}): the ranks are out of step") from e
        elif op == "cancel":
            r = requests.pop(msg["id"], None)
            if r is not None:
                engine.cancel(r)
        elif op == "settle":
            engine.settle()
        elif op == "session":
            sessions.call(msg)
        elif op == "bind":
            requests[msg["id"]] = sessions.submitted()
        else:
            raise RuntimeError(f"unknown mirrored call {op!r} from rank 0")


class Sessions:
    """A follower's sessions, by name: rank 0's session calls (open, set_persist, rewind, submit, checkpoint,
    close) made on this rank's own, in rank 0's order. A call refused here (a UserError) was refused on rank 0
    too, where the client got the error; nothing changed."""

    def __init__(self, open_session: Optional[Callable], make_constraint: Optional[Callable[[str], object]]):
        self.open_session, self.make_constraint = open_session, make_constraint
        self.by_name: Dict[str, object] = {}
        self.turn = None  # the request the last submitted turn made, until rank 0 binds it to its id

    def call(self, msg: dict):
        name, call = msg["name"], msg["call"]
        try:
            if call == "open":
                if self.open_session is None:
                    raise OutOfStep("rank 0 opened a session this rank cannot open")
                self.by_name[name] = self.open_session(name, **msg["kwargs"])
            elif call == "submit":
                self.turn = self.by_name[name].submit(msg["prompt"], msg["max_tokens"],
                                                      **from_wire(msg["sampling"], self.make_constraint))
            else:
                getattr(self.by_name[name], call)(*msg["args"], **msg["kwargs"])
                if call == "close":
                    del self.by_name[name]
        except UserError:
            self.turn = None

    def submitted(self):
        if self.turn is None:
            raise OutOfStep("rank 0 queued a session turn this rank refused: the ranks are out of step")
        turn, self.turn = self.turn, None
        return turn
