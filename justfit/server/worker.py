"""The seam between HTTP and the engine: one worker thread owns every MLX call of the server.

The thread owns the continuous-batching engine (`rt.batch_engine()`, justfit/engine). Each loop
iteration it takes the jobs that arrived, submits them to the engine, runs one `engine.step()` (one
batched forward pass over every running request) and forwards each request's new chunks to its job's
asyncio queue. Every request runs on the engine, grammars and penalties included. A persisted session
(`prompt_cache_key` with `prompt_cache_retention: "24h"`, `--persist`, or a session saved before) runs
its turn on the session's own caches (Session.submit: the history is cut back to what it shares with the
prompt and only the rest is prefilled); the session records the reply and checkpoints when it finishes.
A client that goes away sets `cancelled`: its engine request is cancelled at the next iteration and its
private pages are freed at once.
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
WAKE = object()  # put in the inbox to make the thread read idle_release again (keep_alive)


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
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed (shutdown): nobody is listening any more
            pass

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


@dataclass
class Running:
    """A job on the engine: its Request, and when its previous chunk was forwarded (inter-token metrics)."""

    job: Job
    request: object = None
    last: Optional[float] = None


def stats_dict(stats) -> dict:
    """The engine's turn stats as a dict (TurnStats or a plain dict)."""
    if stats is None:
        return {}
    return stats.as_dict() if hasattr(stats, "as_dict") else dict(stats)


def api_error(e: BaseException) -> Exception:
    """The error a client gets for an exception raised while generating."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, MemoryBudgetError):  # the memory budget is full now: retry later, never an OOM
        return APIError(503, f"out of memory budget: {e}", code="memory_budget", retry_after=5)
    if isinstance(e, UserError):  # the engine refused an option or the session: the client's to fix
        return APIError(400, str(e), code="invalid_value")
    return e


class Worker:
    """Owns the generation thread, the engine, the job inbox and the open sessions."""

    def __init__(self, rt, metrics, max_queue: int = 64, idle_release: Optional[float] = None,
                 persist: bool = False, lock=None):
        self.rt, self.metrics, self.max_queue = rt, metrics, max_queue
        self.lock = lock if lock is not None else threading.RLock()  # shared by the workers of one server: one runs MLX at a time
        self.idle_release, self.persist = idle_release, persist
        self.idle_default = idle_release  # what keep_alive() returns to when a request does not ask
        self.batch_peak = 0  # most requests batched at once since the heap was last trimmed
        self.jobs: "queue.Queue[Optional[Job]]" = queue.Queue()
        self.sessions: dict = {}
        self.engine = None  # made on the thread
        self.batched: List[Running] = []  # jobs on the engine
        self.batch = {"queued": 0, "running": 0, "max_running": 0, "steps": 0, "preempted": 0}  # last snapshot
        self.in_flight = 0  # accepted and not finished (the thread's count)
        self.released = False
        self.restore_s = 0.0  # the last session opened from disk took this long
        self.idle_since = time.time()  # when the last job ended (Ollama's /api/ps expiry counts from it)
        self.thread = threading.Thread(target=self._loop, name="justfit-engine", daemon=True)
        self.thread.start()

    @property
    def queue_length(self) -> int:
        """Requests accepted and not finished: waiting or generating."""
        return self.jobs.qsize() + self.in_flight

    @property
    def waiting(self) -> int:
        """Requests not generating yet: in the inbox or in the engine's queue."""
        return self.jobs.qsize() + self.batch["queued"]

    def snapshot(self) -> dict:
        """For /metrics: waiting, running (the engine's batch), max_running (its largest so far), steps,
        preempted."""
        return {**self.batch, "waiting": self.waiting}

    def submit(self, job: Job) -> Job:
        """Queue a job (503 with retry-after when the queue is full)."""
        if self.waiting >= self.max_queue:
            raise APIError(503, f"server busy: {self.max_queue} requests queued; retry shortly", code="queue_full",
                           retry_after=1)
        job.loop, job.out = asyncio.get_running_loop(), asyncio.Queue()
        self.jobs.put(job)
        return job

    def keep_alive(self, seconds: Optional[float]):
        """Release weights and KV `seconds` after the last job ends (None: never; 0: as soon as idle), until
        set again: Ollama's keep_alive. Wakes the thread, so a shorter time counts from now."""
        self.idle_release = seconds
        self.jobs.put(WAKE)

    def close(self):
        """Stop the thread (running requests end with a 503) and checkpoint every open session; under
        --persist also write the prefix cache's pages, so after a restart every API's prompts (Anthropic
        Messages, Responses without a stored response, chat without a session) find their prefixes."""
        self.jobs.put(None)
        self.thread.join(timeout=30)
        for name, s in list(self.sessions.items()):
            try:
                with self.lock:
                    s.close()
            except Exception as e:  # noqa: BLE001  (one bad session must not stop the others' checkpoints)
                log.warning("session %r: checkpoint on shutdown failed: %s", name, e)
        self.sessions.clear()
        if self.persist:
            try:
                written = self.rt.index.save_pages()
                log.info("prefix cache saved: %.1f MB written", written / 1e6)
            except Exception as e:  # noqa: BLE001  (the sessions are saved; only the shared cache is not)
                log.warning("prefix cache: saving on shutdown failed: %s", e)

    # -- the thread -----------------------------------------------------------------------------
    def _loop(self):
        from ..models.vocab import vocab_size
        from ..grammar import ll_tokenizer

        ll_tokenizer(self.rt.tokenizer, vocab_size(self.rt.model))  # built once here, not in the first tool request
        with self.lock:
            self.engine = self.rt.batch_engine()
        while True:
            try:
                jobs = self._take()
            except queue.Empty:
                with self.lock:
                    self._release()
                continue
            if any(j is None for j in jobs):
                return self._stop([j for j in jobs if j is not None])
            with self.lock:
                for job in jobs:
                    self.released = False
                    self._start(job)
                self.batch_peak = max(self.batch_peak, len(self.batched))
                self._step()
                self._trim_when_drained()
            time.sleep(0)  # another model's worker waiting on the lock gets its turn

    def _trim_when_drained(self):
        """Once a batch of concurrent requests has drained and nothing waits, give glibc's free arena pages
        back to the OS: glibc keeps what the burst freed in its arenas, so RSS stayed near the burst's
        peak long after it (docs/reliability.md). Not after lone requests: there is little to return."""
        if self.batched or self.batch_peak < 2 or not self.jobs.empty():
            return
        from ..phaseswap.residency import trim_heap

        self.batch_peak = 0
        trim_heap()

    def _take(self) -> List[Optional[Job]]:
        """Jobs that arrived; waits for one when nothing runs (queue.Empty after idle_release seconds idle)."""
        jobs = []
        if not self.batched:
            jobs.append(self.jobs.get(timeout=self.idle_release if not self.released else None))
        while True:
            try:
                jobs.append(self.jobs.get_nowait())
            except queue.Empty:
                return [j for j in jobs if j is not WAKE]

    def _start(self, job: Job):
        """Submit a job to the engine (opening its persisted session first, so its pages are found)."""
        self.in_flight += 1
        if job.cancelled.is_set():
            return self._end(Running(job), error=APIError(499, "client closed the request"))
        try:
            s = self._session(job.session) if self._persisted(job) else None
            if s is not None and s.running is None:
                req = self._session_turn(s, job)
            else:  # no session, or its turn is running: a plain request (the index still has its pages)
                req = self.engine.submit(job.prompt, job.max_tokens, **self._options(job))
        except Exception as e:  # noqa: BLE001  (refused before it joined: the batch is untouched)
            return self._fail(Running(job), e)
        self.batched.append(Running(job, request=req))

    def _session_turn(self, s, job: Job):
        """The job as the session's next turn, on the session's own caches: the history is cut back to what
        it shares with the prompt (token-exact), the rest is the turn's new input; the session records the
        reply and checkpoints when the engine finishes it."""
        s.set_persist(True)
        keep = min(common_prefix(s.tokens, job.prompt), len(job.prompt) - 1)
        s.rewind(len(s.tokens) - keep)
        opts = self._options(job)
        return s.submit(job.prompt[keep:], job.max_tokens, opts.pop("temperature", 0.0), opts.pop("seed", None),
                        opts.pop("top_p", 1.0), **opts)

    def _persisted(self, job: Job) -> bool:
        """Is the job a turn of a persisted session (retention asked, --persist, or open or saved before)?"""
        from ..statetrans.manifest import manifest_path

        name = job.session
        return name is not None and (job.persist or self.persist or name in self.sessions
                                     or manifest_path(self.rt.home, name).exists())

    def _options(self, job: Job) -> dict:
        opts = {k: v for k, v in job.options.items() if v is not None}
        if job.grammar:
            from ..models.vocab import vocab_size
            from ..grammar import Constraint

            opts["constraint"] = Constraint(self.rt.tokenizer, vocab_size(self.rt.model), job.grammar)
        return opts

    def _step(self):
        """One batched step, then every engine job's new chunks to its client; finished jobs end."""
        for r in [r for r in self.batched if r.job.cancelled.is_set()]:
            r.request.cancel()  # private pages freed now, before the step
            self.metrics.cancelled += 1
            self._end(r, error=APIError(499, "client closed the request"))
        finished = 0
        if self.batched:
            try:
                self.engine.step()
            except Exception as e:  # noqa: BLE001  (a failed step fails the requests in it, not the server)
                log.exception("batch step failed")
                for r in list(self.batched):
                    r.request.cancel()
                    self._fail(r, e)
            for r in list(self.batched):
                self._forward(r, r.request.chunks)
            if any(r.request.done for r in self.batched):
                self.engine.settle()  # finished sessions' turns are recorded and checkpointed
            for r in list(self.batched):
                if r.request.done:
                    finished += 1
                    if r.request.failure is not None:  # the reply is delivered; only its persistence failed
                        log.warning("session %r: could not save the turn: %s", r.job.session, r.request.failure)
                    self._finish(r, r.request.stats)
        rep = self.engine.report()  # a snapshot for /metrics (read on the event loop's thread)
        self.batch = {"queued": rep["queued"], "running": rep["running"], "steps": rep["steps"],
                      "preempted": rep["preempted"],
                      "max_running": max(self.batch["max_running"], rep["running"] + finished)}

    def _forward(self, r: Running, chunks):
        while chunks:
            now = time.perf_counter()
            if r.last is not None:
                self.metrics.gap(now - r.last)
            r.last = now
            r.job.emit("chunk", chunks.popleft())

    def _finish(self, r: Running, stats):
        stats = stats_dict(stats)
        self.metrics.turn(len(r.job.prompt), stats.get("generated_tokens", 0), stats.get("reused_tokens", 0),
                          stats.get("ttft_s"))
        self._end(r, stats=stats)

    def _fail(self, r: Running, e: BaseException):
        err = api_error(e)
        if not isinstance(err, APIError):
            log.error("generation failed: %s: %s", type(e).__name__, e, exc_info=e)
        self._end(r, error=err)

    def _end(self, r: Running, stats: Optional[dict] = None, error: Optional[Exception] = None):
        if r in self.batched:
            self.batched.remove(r)
        self.in_flight -= 1
        self.idle_since = time.time()
        r.job.emit("error", error) if error is not None else r.job.emit("end", stats)

    def _stop(self, arrived: List[Job]):
        """Shutdown: whatever still runs or waits ends with a 503 (uvicorn already waited for open requests)."""
        gone = APIError(503, "the server is shutting down", code="shutting_down", retry_after=5)
        while True:  # jobs that arrived with or after the stop
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            arrived += [job] if job is not None and job is not WAKE else []
        for job in arrived:
            self.in_flight += 1
            self._end(Running(job), error=gone)
        for r in list(self.batched):
            r.request.cancel()
            self._end(r, error=gone)

    def _session(self, name: str):
        s = self.sessions.pop(name, None)
        if s is None:
            start = time.perf_counter()
            try:
                s = self.rt.session(name)
                self.restore_s = time.perf_counter() - start  # opening it from disk: its KV restored
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
