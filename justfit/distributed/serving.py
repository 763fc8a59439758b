"""`justfit serve` under mlx.launch: rank 0 owns the HTTP front and leads each turn, the others mirror it.

Turns run one at a time through the single-sequence path (`Runtime.stream`). Before a turn, rank 0
broadcasts it as JSON: prompt ids, max_tokens and the sampling options. Every follower then runs the
same `rt.stream`, so the collectives inside the model line up step for step. After each chunk, rank 0
broadcasts whether the turn goes on. A client that disconnects therefore stops the turn at the same
token on every rank. Prefix reuse needs no broadcast: every rank runs the same turns in the same
order, so its prefix index makes the same choices.

Three things cannot be mirrored yet and are refused in one line: options that do not travel as JSON
(grammar constraints for tools and response_format; frequency/presence penalties), prompt_cache_key
sessions, and --idle-release. Batching fronts get `SerialEngine`, which has the Engine's surface but
runs one request at a time.

A dead rank: a collective that starts after a rank died raises, but one already inside an evaluation
(a model step) waits forever (MLX 0.32 ring). So rank 0 also watches the processes of the ranks on its
own host, and exits 1 with the dead rank named as soon as one is gone. Ranks on other hosts are
watched by mlx.launch, which sends rank 0 a SIGTERM when one dies; the server then drains and exits 1.
"""

import itertools
import json
import logging
import os
import random
import signal
import socket
import sys
import threading
from collections import deque
from typing import Callable, Optional

from ..errors import MemoryBudgetError, UserError
from ..turns import Generation, Submitted, TurnStats
from .world import World, broadcast_json, gather_strings, world

log = logging.getLogger("justfit.server")
MIRRORED = ("top_k", "min_p", "repetition_penalty", "stop", "logit_bias")  # options that travel as JSON
NOT_MIRRORED = ("tools, response_format and frequency/presence penalties are not supported by `justfit serve` "
                "under mlx.launch yet (the other ranks cannot mirror them); leave them out or serve on one rank")


def lost(e: BaseException) -> bool:
    """Did a collective fail because a rank went away (ring: 'connection to a peer was lost')?"""
    text = str(e)
    return isinstance(e, RuntimeError) and (text.startswith("[ring]") or text.startswith("[mpi]") or "peer" in text)


def turn_options(temperature: float, seed: Optional[int], top_p: float, options: dict) -> dict:
    """The sampling options of one turn as JSON; a UserError for options that cannot be mirrored."""
    if options.get("logits_processors") or options.get("constraint") is not None:
        raise UserError(NOT_MIRRORED)
    unknown = sorted(k for k, v in options.items() if v is not None and k not in MIRRORED
                     and k not in ("logits_processors", "constraint"))
    if unknown:
        raise UserError(f"option(s) {', '.join(unknown)} cannot be mirrored to the other ranks under mlx.launch")
    if seed is None and temperature > 0:  # every rank must draw the same random tokens
        seed = random.SystemRandom().randrange(1 << 62)
    out = {"temperature": float(temperature), "top_p": float(top_p), "seed": seed}
    out.update({k: options[k] for k in MIRRORED if options.get(k) is not None})
    if "logit_bias" in out:  # JSON object keys are strings: send pairs
        out["logit_bias"] = [[int(k), float(v)] for k, v in out["logit_bias"].items()]
    if isinstance(out.get("stop"), str):
        out["stop"] = [out["stop"]]
    return out


def _stream_kwargs(turn: dict) -> dict:
    kw = {k: v for k, v in turn.items() if k not in ("op", "tokens")}
    if "logit_bias" in kw:
        kw["logit_bias"] = {int(k): float(v) for k, v in kw["logit_bias"]}
    return kw


def _flag(go: Optional[bool], w: World) -> bool:
    """Rank 0's go/stop after a chunk, on every rank. The step's own collectives (queued on the
    generation stream) finish first, so every rank sees the same order of collectives."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    if w.size == 1:
        return bool(go)
    mx.synchronize(generation_stream)
    mine = int(bool(go)) if w.is_front else 0
    return bool(mx.distributed.all_sum(mx.array([mine], dtype=mx.int32), group=w.group).item())


class Leader:
    """Rank 0's Runtime for a front that only rank 0 sees: the Runtime's API, and the followers
    (`follow_turns`) mirror every turn. `on_lost` runs once when a rank goes away."""

    serialized = True  # fronts: requests run one at a time (batching is serialized, see SerialEngine)

    def __init__(self, rt, w: Optional[World] = None, on_lost: Optional[Callable[[], None]] = None):
        self.rt, self.world, self.on_lost = rt, w or world(), on_lost
        self.lost: Optional[str] = None
        self.engine = None
        self._turn_lock = threading.Lock()

    def __getattr__(self, name):  # model, tokenizer, index, phaseswap, home, sharding, last_stats ...
        return getattr(self.rt, name)

    def session(self, name, **options):
        if name is None:
            raise UserError("in-memory sessions are not mirrored under mlx.launch yet")
        raise UserError("prompt_cache_key sessions are not supported by `justfit serve` under mlx.launch yet; "
                        "leave prompt_cache_key out (prefix reuse still works) or serve on one rank")

    def stream(self, prompt, max_tokens: int = 256, temperature: float = 0.0, seed: Optional[int] = None,
               top_p: float = 1.0, **options):
        """Runtime.stream, mirrored: options are checked now, the turn runs as the chunks are taken."""
        options.pop("progress", None)
        turn = {"op": "turn", "tokens": self.rt.encode(prompt), "max_tokens": max_tokens,
                **turn_options(temperature, seed, top_p, options)}
        return self._turn(turn)

    def generate(self, prompt, max_tokens: int = 256, temperature: float = 0.0, seed: Optional[int] = None,
                 top_p: float = 1.0, **options) -> Generation:
        chunks = list(self.stream(prompt, max_tokens, temperature, seed, top_p, **options))
        return Generation("".join(c.text for c in chunks), [c.token for c in chunks if c.token >= 0],
                          self.rt.last_stats)

    def _turn(self, turn: dict):
        if self.lost:
            raise RuntimeError(self.lost)
        if not self._turn_lock.acquire(blocking=False):  # waiting here would deadlock the calling thread
            raise RuntimeError("another mirrored turn is in progress: under mlx.launch turns run one at a time")
        try:
            self._send(turn)
            gen = self.rt.stream(turn["tokens"], **_stream_kwargs(turn))
            try:
                for chunk in gen:
                    yield chunk
                    self._go(True)
            except RuntimeError as e:
                if lost(e):
                    self._lose(e)
                raise
            finally:
                gen.close()
                if not self.lost:
                    self._go(False)
        finally:
            self._turn_lock.release()

    def _send(self, msg: dict):
        try:
            broadcast_json(msg, self.world)
        except RuntimeError as e:
            self._lose(e)
            raise

    def _go(self, go: bool):
        try:
            _flag(go, self.world)
        except RuntimeError as e:
            self._lose(e)
            raise

    def _lose(self, e: BaseException):
        if self.lost is None:
            self.lost = f"lost a rank of the mlx.launch world ({e}); the server stops"
            log.error("%s", self.lost)
            if self.on_lost is not None:
                self.on_lost()

    def stop(self, timeout: float = 10, before: Optional[Callable[[], None]] = None) -> Optional[str]:
        """Tell the followers to return (after any turn in progress, calling `before()` first); None, or
        why the world was lost."""
        if self.lost:
            return self.lost
        if not self._turn_lock.acquire(timeout=timeout):
            return (f"lost a rank of the mlx.launch world? a turn was still running {timeout:.0f} s after shutdown "
                    "(a rank that died leaves the others waiting); the other ranks were not told to stop")
        try:
            if before is not None:
                before()
            self._send({"op": "stop"})
        except RuntimeError:
            pass  # recorded in self.lost
        finally:
            self._turn_lock.release()
        return self.lost

    # -- batching fronts --------------------------------------------------------------------------
    def batch_engine(self, *args, **kwargs) -> "SerialEngine":
        if self.engine is None:
            self.engine = SerialEngine(self)
        return self.engine

    def submit(self, prompt, max_tokens: int = 256, **sampling) -> "SerialRequest":
        return self.batch_engine().submit(self.rt.encode(prompt), max_tokens, **sampling)

    def generate_batch(self, prompts, max_tokens: int = 256, **sampling):
        reqs = [self.submit(p, max_tokens, **sampling) for p in prompts]
        return self.batch_engine().run(reqs)


class SerialRequest(Submitted):
    """The scheduler Request's surface (iterate for Chunks, cancel, result, done, chunks, stats) over one
    mirrored turn."""

    def __init__(self, engine: "SerialEngine", rid: int, prompt, turn):
        self.engine, self.id, self.prompt, self._turn = engine, rid, list(prompt), turn
        self.chunks: deque = deque()
        self.text, self.out = [], []
        self.stats = TurnStats(prompt_tokens=len(self.prompt))
        self.state, self.finish_reason = "queued", None

    def _advance(self):
        self.state = "running"
        try:
            chunk = next(self._turn)
        except StopIteration:
            return self._finish()
        except BaseException:
            self._finish()
            raise
        self.chunks.append(chunk)
        self.text.append(chunk.text)
        if chunk.token >= 0:
            self.out.append(chunk.token)

    def _finish(self):
        self._turn.close()
        self.state = "done"
        self.stats = self.engine.leader.rt.last_stats
        self.finish_reason = self.stats.finish_reason


class SerialEngine:
    """The scheduler Engine's surface (submit, step, run, cancel, report) for fronts written for batching:
    under mlx.launch requests run one at a time through Leader.stream, one chunk per step."""

    def __init__(self, leader: Leader):
        self.leader, self.queue, self.current = leader, deque(), None
        self.steps, self.preempted, self._ids = 0, 0, itertools.count()

    def submit(self, prompt, max_tokens: int = 256, **sampling) -> SerialRequest:
        turn = self.leader.stream(list(prompt), max_tokens, **sampling)  # bad options: a UserError now
        r = SerialRequest(self, next(self._ids), prompt, turn)
        self.queue.append(r)
        return r

    def step(self) -> int:
        """One chunk of the request in progress (the oldest queued one starts when none is)."""
        if self.current is None or self.current.done:
            self.current = self.queue.popleft() if self.queue else None
        if self.current is None:
            return 0
        self.steps += 1
        self.current._advance()
        return 1

    def settle(self):
        """Nothing to feed after a turn: every rank's caches are the group's own."""

    def cancel(self, r: SerialRequest):
        if r in self.queue:
            self.queue.remove(r)
        if not r.done:
            r._finish()

    def run(self, requests):
        return [r.result() for r in requests]

    def report(self) -> dict:
        running = int(self.current is not None and not self.current.done)
        return {"queued": len(self.queue), "running": running, "steps": self.steps, "preempted": 0,
                "kv_bytes": 0, "budget_bytes": 0}


def follow_turns(rt, w: Optional[World] = None) -> int:
    """Ranks > 0: mirror every turn rank 0 leads until it says stop; returns how many turns ran."""
    w = w or world()
    n = 0
    while True:
        turn = broadcast_json(None, w)
        if turn["op"] == "stop":
            return n
        _mirror(rt, turn, w)
        n += 1


def _mirror(rt, turn: dict, w: World):
    gen = rt.stream(turn["tokens"], **_stream_kwargs(turn))
    try:
        for _ in gen:
            if not _flag(None, w):
                return
        _flag(None, w)  # rank 0's end of turn
    except (UserError, MemoryBudgetError):  # rank 0 refused the same turn at the same point
        _flag(None, w)
    finally:
        gen.close()


def peers(w: World) -> list:
    """[rank, host, pid] of every rank (one collective, at startup)."""
    return [json.loads(x) for x in gather_strings(json.dumps([w.rank, socket.gethostname(), os.getpid()]), w)]


def watch_local_ranks(ranks: list, on_dead: Callable[[int, int], None], interval: float = 1.0) -> threading.Event:
    """A daemon thread that calls on_dead(rank, pid) once a rank on this host has exited (or is a zombie);
    set the returned Event to stop watching (before the ranks are told to exit)."""
    import psutil

    host = socket.gethostname()
    local = [(r, pid) for r, h, pid in ranks if h == host and pid != os.getpid()]

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    done = threading.Event()

    def run():
        while not done.wait(interval):
            dead = next(((r, pid) for r, pid in local if not alive(pid)), None)
            if dead and not done.is_set():
                return on_dead(*dead)

    threading.Thread(target=run, name="justfit-ranks", daemon=True).start()
    return done


def _front_dies(rank: int, pid: int):
    """Rank 0, when a rank on its host died: its turn may be stuck inside MLX, so say so and exit now."""
    print(f"justfit: error: lost a rank of the mlx.launch world: rank {rank} (pid {pid}) died; the server stops",
          file=sys.stderr, flush=True)
    logging.shutdown()
    os._exit(1)


class Terminated(Exception):
    """SIGTERM reached rank 0 (from the user, or from mlx.launch after another rank died)."""


def _terminate(signum, frame):
    raise Terminated()


def run_front(rt, serve: Callable) -> Optional[str]:
    """Rank 0 runs `serve(leader)` until SIGTERM/SIGINT, the others follow its turns; returns None, or why
    a rank was lost. A lost rank sends rank 0 a SIGTERM, so its server drains and stops."""
    w = world()
    ranks = peers(w)  # every rank takes part in this collective
    if not w.is_front:
        try:
            follow_turns(rt, w)
        except RuntimeError as e:
            if lost(e):
                return f"rank {w.rank} lost rank 0 of the mlx.launch world ({e})"
            raise
        return None
    # uvicorn re-raises the SIGTERM it caught once it has drained: land in this handler, not the default
    # one (which would end the process before the followers are told to stop)
    previous = signal.signal(signal.SIGTERM, _terminate)
    watching = watch_local_ranks(ranks, _front_dies)
    leader = Leader(rt, w, on_lost=lambda: os.kill(os.getpid(), signal.SIGTERM))
    try:
        serve(leader)
    except (Terminated, KeyboardInterrupt):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        why = leader.stop(before=watching.set)  # the followers exit once told to stop: not a death
    return why
