"""`justfit serve` under mlx.launch: rank 0 owns the HTTP front, every rank runs the one engine core.

Rank 0's front gets a `Leader`: the Runtime's API over rank 0's engine, whose outside calls (submit,
cancel, step) are broadcast before they run; the other ranks replay them on their own engine
(`follow_turns`), and rank 0's answers decide what each rank would measure differently (mirror.py). So
requests batch, and tools, JSON output (grammar constraints) and frequency/presence penalties work as on
one rank. Persisted prompt_cache_key sessions work too: every rank holds the session over its own shard and
repeats rank 0's session calls (mirrored_session.py). Refused in one line: custom logits processors and
--idle-release.

A dead rank: a collective that starts after a rank died raises, but one already inside an evaluation
(a model step) waits forever (MLX 0.32 ring). So rank 0 also watches the processes of the ranks on its
own host, and exits 1 with the dead rank named as soon as one is gone. Ranks on other hosts are
watched by mlx.launch, which sends rank 0 a SIGTERM when one dies; the server then drains and exits 1.
"""

import json
import logging
import os
import signal
import socket
import sys
import threading
from typing import Callable, Optional

from ..errors import UserError
from .mirror import CALLER_CACHES, Lead, OutOfStep, Peer, follow, post, receive
from .world import World, gather_strings, world

log = logging.getLogger("justfit.server")

def lost(e: BaseException) -> bool:
    """Did a collective fail because a rank went away (ring: 'connection to a peer was lost')?"""
    text = str(e)
    return isinstance(e, RuntimeError) and (text.startswith("[ring]") or text.startswith("[mpi]") or "peer" in text)


class Leader:
    """Rank 0's Runtime for a front that only rank 0 sees: the Runtime's API (batch_engine, submit, stream,
    generate, generate_batch) over the mirrored engine. `make_constraint(grammar)` builds a grammar
    constraint on the other ranks (None: grammars are refused); `on_lost` runs once when a rank goes away."""

    def __init__(self, rt, w: Optional[World] = None, on_lost: Optional[Callable[[], None]] = None,
                 make_constraint: Optional[Callable[[str], object]] = None):
        self.rt, self.world, self.on_lost = rt, w or world(), on_lost
        self.grammars = make_constraint is not None
        self.lost: Optional[str] = None
        self.engine = None  # rank 0's engine core, its consensus a Lead (made on first use)
        self.lead: Optional[Lead] = None  # that consensus: announces the engine's calls
        self._posted: tuple = ()  # the last message's collectives, in flight

    def __getattr__(self, name):  # model, tokenizer, index, phaseswap, home, sharding, encode ...
        return getattr(self.rt, name)

    def session(self, name, **options):
        """A named session that every rank opens over its own shard (mirrored_session.py)."""
        from .mirrored_session import MirroredSession

        if name is None:
            raise UserError(CALLER_CACHES)
        with self.batch_engine().lock:
            self.announce({"op": "session", "name": name, "call": "open", "kwargs": options})
            return MirroredSession(self, self.rt.session(name, **options))

    def announce(self, msg: dict):
        """Send one call to the other ranks (under the engine's lock: in the engine's own order)."""
        self._send(msg)

    def batch_engine(self, *args, **options):
        """The Runtime's engine core, its calls mirrored to the other ranks (made on first use; engine
        options would have to match on every rank, so none are taken)."""
        if args or options:
            raise UserError("engine options are not mirrored under mlx.launch; use the defaults")
        if self.engine is None:
            self.engine = self.rt.batch_engine()
            self.lead = Lead(self.world, self._send, self.grammars, self._failed)
            self.engine.use_peer(self.lead)
        return self.engine

    def submit(self, prompt, max_tokens: int = 256, **sampling):
        return self.batch_engine().submit(self.rt.encode(prompt), max_tokens, **sampling)

    def stream(self, prompt, max_tokens: int = 256, temperature: float = 0.0, seed: Optional[int] = None,
               top_p: float = 1.0, **options):
        """Runtime.stream on the mirrored engine: iterate the returned request for Chunks."""
        return self.submit(prompt, max_tokens, temperature=temperature, seed=seed, top_p=top_p, **options)

    def generate(self, prompt, max_tokens: int = 256, temperature: float = 0.0, seed: Optional[int] = None,
                 top_p: float = 1.0, **options):
        return self.stream(prompt, max_tokens, temperature, seed, top_p, **options).result()

    def generate_batch(self, prompts, max_tokens: int = 256, **sampling):
        reqs = [self.submit(p, max_tokens, **sampling) for p in prompts]
        return self.batch_engine().run(reqs)

    def _send(self, msg: dict):
        if self.lost:
            raise RuntimeError(self.lost)
        try:
            if self.world.size > 1:
                self._posted = post(msg, self.world)
        except RuntimeError as e:
            self._failed(e)
            raise

    def _failed(self, e: BaseException):
        if lost(e):
            self._lose(e)

    def _lose(self, e: BaseException):
        if self.lost is None:
            self.lost = f"lost a rank of the mlx.launch world ({e}); the server stops"
            log.error("%s", self.lost)
            if self.on_lost is not None:
                self.on_lost()

    def stop(self, timeout: float = 10, before: Optional[Callable[[], None]] = None) -> Optional[str]:
        """Tell the followers to return (after any step in progress, calling `before()` first); None, or
        why the world was lost."""
        if self.lost:
            return self.lost
        lock = self.engine.lock if self.engine is not None else threading.RLock()
        if not lock.acquire(timeout=timeout):
            return (f"lost a rank of the mlx.launch world? a step was still running {timeout:.0f} s after shutdown "
                    "(a rank that died leaves the others waiting); the other ranks were not told to stop")
        try:
            if before is not None:
                before()
            self._send({"op": "stop"})
            if self._posted:
                import mlx.core as mx

                mx.eval(*self._posted)  # the followers have it before this process goes on to exit
        except RuntimeError as e:
            self._failed(e)  # recorded in self.lost
        finally:
            lock.release()
        return self.lost


def follow_turns(rt, w: Optional[World] = None, make_constraint: Optional[Callable[[str], object]] = None) -> int:
    """Ranks > 0: replay rank 0's engine calls on this rank's engine until it says stop; returns the steps run."""
    w = w or world()
    engine = rt.batch_engine()
    engine.use_peer(Peer(w))
    return follow(engine, lambda: receive(w), make_constraint, open_session=rt.session)


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


def run_front(rt, serve: Callable, make_constraint: Optional[Callable[[str], object]] = None) -> Optional[str]:
    """Rank 0 runs `serve(leader)` until SIGTERM/SIGINT, the others replay its engine calls; returns None,
    or why a rank was lost. A lost rank sends rank 0 a SIGTERM, so its server drains and stops.
    make_constraint(grammar): a grammar constraint on the other ranks (None: grammars are refused)."""
    w = world()
    ranks = peers(w)  # every rank takes part in this collective
    if not w.is_front:
        try:
            follow_turns(rt, w, make_constraint)
        except OutOfStep as e:
            return f"rank {w.rank}: {e}"
        except RuntimeError as e:
            if lost(e):
                return f"rank {w.rank} lost rank 0 of the mlx.launch world ({e})"
            raise
        return None
    # uvicorn re-raises the SIGTERM it caught once it has drained: land in this handler, not the default
    # one (which would end the process before the followers are told to stop)
    previous = signal.signal(signal.SIGTERM, _terminate)
    watching = watch_local_ranks(ranks, _front_dies)
    leader = Leader(rt, w, on_lost=lambda: os.kill(os.getpid(), signal.SIGTERM), make_constraint=make_constraint)
    try:
        serve(leader)
    except (Terminated, KeyboardInterrupt):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        why = leader.stop(before=watching.set)  # the followers exit once told to stop: not a death
    return why
