"""The seam between HTTP and the engine: one worker thread runs generations in arrival order.

Until batching lands (issue 13: `rt.submit`), the engine generates one sequence at a time, so every
request is queued here and the event loop never blocks on MLX. A job streams (kind, value) events back
to its request through an asyncio queue; a client that goes away sets `cancelled`, the worker stops
iterating the engine's stream at the next token and closes it (its pages are released in the
engine's `finally`). Swapping in rt.submit replaces `_loop` and `_generate` only.
"""

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import List, Optional

from ..errors import MemoryBudgetError, UserError
from ..statetrans.index import common_prefix
from .errors import APIError

log = logging.getLogger("justfit.server")
MAX_SESSIONS = 16


@dataclass
class Job:
    """One reply to generate: prompt ids, engine options, the session it extends (if any)."""

    prompt: List[int]
    max_tokens: int
    options: dict
    session: Optional[str] = None
    persist: bool = False
    grammar: Optional[str] = None  # compiled into a Constraint on the worker thread (the first takes ~3 s)
    loop: Optional[asyncio.AbstractEventLoop] = None
    out: Optional[asyncio.Queue] = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.perf_counter)

    def emit(self, kind: str, value=None):
        self.loop.call_soon_threadsafe(self.out.put_nowait, (kind, value))

    async def events(self):
        """(kind, value) events: ('chunk', Chunk)..., then ('end', stats) or ('error', exc)."""
        finished = False
        try:
            while True:
                kind, value = await self.out.get()
                finished = kind in ("end", "error")
                yield kind, value
                if finished:
                    return
        finally:
            if not finished:
                self.cancelled.set()


def stats_dict(stats) -> dict:
    """The engine's turn stats as a dict (TurnStats or a plain dict)."""
    if stats is None:
        return {}
    return stats.as_dict() if hasattr(stats, "as_dict") else dict(stats)


class Worker:
    """Owns the generation thread, the job queue and the open sessions."""

    def __init__(self, rt, metrics, max_queue: int = 64, idle_release: Optional[float] = None,
                 persist: bool = False):
        self.rt, self.metrics, self.max_queue = rt, metrics, max_queue
        self.idle_release, self.persist = idle_release, persist
        self.jobs: "queue.Queue[Optional[Job]]" = queue.Queue()
        self.sessions: dict = {}
        self.busy = False
        self.released = False
        self.thread = threading.Thread(target=self._loop, name="justfit-engine", daemon=True)
        self.thread.start()

    @property
    def queue_length(self) -> int:
        return self.jobs.qsize() + int(self.busy)

    def submit(self, job: Job) -> Job:
        """Queue a job (503 with retry-after when the queue is full)."""
        if self.jobs.qsize() >= self.max_queue:
            raise APIError(503, f"server busy: {self.max_queue} requests queued; retry shortly", code="queue_full",
                           retry_after=1)
        job.loop, job.out = asyncio.get_running_loop(), asyncio.Queue()
        self.jobs.put(job)
        return job

    def close(self):
        """Stop the thread after the running job and checkpoint every open session."""
        self.jobs.put(None)
        self.thread.join(timeout=30)
        for name, s in list(self.sessions.items()):
            try:
                s.close()
            except Exception as e:  # noqa: BLE001  (one bad session must not stop the others' checkpoints)
                log.warning("session %r: checkpoint on shutdown failed: %s", name, e)
        self.sessions.clear()

    # -- the thread -----------------------------------------------------------------------------
    def _loop(self):
        from ..models.vocab import vocab_size
        from ..grammar import ll_tokenizer

        ll_tokenizer(self.rt.tokenizer, vocab_size(self.rt.model))  # built once here, not in the first tool request
        while True:
            try:
                job = self.jobs.get(timeout=self.idle_release if not self.released else None)
            except queue.Empty:
                self._release()
                continue
            if job is None:
                return
            self.released, self.busy = False, True
            try:
                self._run(job)
            finally:
                self.busy = False

    def _run(self, job: Job):
        if job.cancelled.is_set():
            job.emit("error", APIError(499, "client closed the request"))
            return
        src, stream = None, None
        try:
            src, stream = self._generate(job)
            last = None
            for chunk in stream:
                if job.cancelled.is_set():
                    self.metrics.cancelled += 1
                    break
                now = time.perf_counter()
                if last is not None:
                    self.metrics.gap(now - last)
                last = now
                job.emit("chunk", chunk)
            stream.close()  # a cancelled turn frees its pages here, in the engine's finally
            stats = stats_dict(getattr(src, "last_stats", None))
            self.metrics.turn(len(job.prompt), stats.get("generated_tokens", 0), stats.get("reused_tokens", 0),
                              stats.get("ttft_s"))
            job.emit("end", stats)
        except APIError as e:
            job.emit("error", e)
        except MemoryBudgetError as e:  # the memory budget is full now: retry later, never an OOM
            job.emit("error", APIError(503, f"out of memory budget: {e}", code="memory_budget", retry_after=5))
        except UserError as e:  # the engine refused an option or the session: the client's to fix
            job.emit("error", APIError(400, str(e), code="invalid_value"))
        except Exception as e:  # noqa: BLE001  (reported to the client as a 500 envelope)
            log.exception("generation failed")
            job.emit("error", e)
        finally:
            if stream is not None:
                stream.close()

    def _generate(self, job: Job):
        """(object whose last_stats describe the turn, chunk iterator) for a job."""
        opts = {k: v for k, v in job.options.items() if v is not None}
        if job.grammar:
            from ..models.vocab import vocab_size
            from ..grammar import Constraint

            opts["constraint"] = Constraint(self.rt.tokenizer, vocab_size(self.rt.model), job.grammar)
        if job.session is None:
            return self.rt, self.rt.stream(job.prompt, job.max_tokens, **opts)
        s = self._session(job.session)
        s.set_persist(s.persist or job.persist or self.persist)
        keep = common_prefix(s.tokens, job.prompt)
        keep = min(keep, len(job.prompt) - 1)  # the engine needs at least one new token
        if keep < len(s.tokens):
            s.rewind(len(s.tokens) - keep)
        return s, s.stream(job.prompt[keep:], job.max_tokens, **opts)

    def _session(self, name: str):
        s = self.sessions.pop(name, None)
        if s is None:
            try:
                s = self.rt.session(name)
            except UserError as e:
                raise APIError(400, str(e), "prompt_cache_key", "invalid_value") from None
            s.set_persist(False)
        self.sessions[name] = s  # most recently used last
        while len(self.sessions) > MAX_SESSIONS:
            oldest = next(iter(self.sessions))
            self.sessions.pop(oldest).close()
        return s

    def _release(self):
        """Idle for idle_release seconds: checkpoint sessions, release weights and KV (PhaseSwap)."""
        from ..phaseswap.toolphase import suspend

        for s in self.sessions.values():
            if s.persist:
                s.checkpoint(auto=True)
        freed = suspend(self.rt.phaseswap)
        self.released = True
        log.info("idle for %.0f s: released %.1f MB; the next request reloads", self.idle_release, freed / 1e6)

