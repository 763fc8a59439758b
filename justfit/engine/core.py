"""The engine core: the step loop that every submitted request runs in.

Each step: the scheduler plans (admission, chunked prefill beside decodes, preemption), the runner runs
the plan as one forward pass (or a speculative verify for a lone greedy request), and the core hands each
finished row's token to its Request, which emits text or says it is done; the KV manager releases and
publishes its pages. While every running request decodes greedily, the next pass is queued on this pass's
argmax before it is read, so building the graph overlaps the computation (mlx-lm's loops do the same).
Callers step it synchronously (iterating a Request) or through its one worker thread (`executor`, for
asyncio fronts); a lock keeps steps one at a time.
"""

import itertools
import threading
import time
from typing import Callable, Dict, List, Optional

from ..errors import UserError
from ..models.vocab import check_token_ids, vocab_size
from ..turns import Chunk, Generation, TurnStats
from .consensus import Consensus
from .kv import KVManager
from .request import DONE, RUNNING, Request
from .runner import Runner, follow
from .sampling import Sampling
from .scheduler import MAX_BATCH, STEP_TOKENS, Scheduler


class Engine:
    """One model, one page pool, one loop; fronts (Runtime.submit, the server, benches) submit to it."""

    def __init__(self, model, tokenizer, make_cache: Callable[[], list], index=None, kv=None,
                 budget_bytes: Optional[int] = None, step_tokens: int = STEP_TOKENS, max_batch: int = MAX_BATCH,
                 context: Optional[int] = None, residency=None, eos: Optional[set] = None, drafter=None,
                 gate=None, prefill_with_decode: Optional[int] = None):
        if prefill_with_decode is not None and prefill_with_decode < 1:
            raise UserError(f"prefill_with_decode must be >= 1 row, not {prefill_with_decode}")
        self.tokenizer = tokenizer
        self.consensus = Consensus()  # alone, until serving under mlx.launch plugs in its peer (use_peer)
        self.kv = KVManager(model, make_cache, index, kv, budget_bytes, self.consensus)
        self.scheduler = Scheduler(self.kv, step_tokens, max_batch, prefill_with_decode, self.consensus)
        self.runner = Runner(model, self.kv, residency, self.consensus)
        self.drafter, self.gate = drafter, gate  # a lone plain-greedy request decodes speculatively
        self.counts = {"draft_passes": 0, "drafted_tokens": 0, "accepted_tokens": 0}
        args = getattr(model, "args", None)
        self.context = context or getattr(args, "max_position_embeddings", None) or 1 << 20
        self.vocab = vocab_size(model)
        self.eos = set(getattr(tokenizer, "eos_token_ids", ()) or ()) if eos is None else set(eos)  # stop ids
        self.lock = threading.RLock()
        self.steps = 0
        self._ids = itertools.count()
        self._executor = None
        self._ahead: Optional[tuple] = None  # (plan, logits, argmax) of the next step, queued early
        self._wait = False  # a lone request's drafter will propose: the next pass is not queued early
        self._t_last: Optional[float] = None  # when the last overlapped lone step's token was taken
        self._tails: List[tuple] = []  # (request, its caller-owned caches, ids): last tokens still to feed

    @property
    def budget_bytes(self) -> Optional[int]:
        return self.kv.budget_bytes

    # -- requests ----------------------------------------------------------------------------------
    def submit(self, tokens: List[int], max_tokens: int = 256, caches: Optional[list] = None, reused: int = 0,
               progress: Optional[Callable] = None, stats: Optional[TurnStats] = None,
               sampling: Optional[Sampling] = None, on_done: Optional[Callable] = None, **options) -> Request:
        """Queue a request; bad requests raise UserError here and never touch the running batch.

        caches: the caller's own per-layer caches already holding tokens[:reused] (a session's history, a
        prefix lookup's): the turn runs on them and leaves them holding the whole turn, end-of-turn id
        included, so the next turn reuses every token. Otherwise the engine makes caches, attaches the
        longest cached prefix and publishes the pages when done. progress(done, total) after each prefill
        chunk; stats: the caller's TurnStats to fill; sampling: a Sampling, or its fields as options;
        on_done(request): called once it is finished and `caches` hold the turn (a session records it)."""
        tokens = list(tokens)
        announced = self.consensus.submitting(options, caches, sampling)  # may refuse; may fix the seed
        if not tokens:
            raise UserError("the prompt is empty: give at least one token")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise UserError(f"max_tokens must be an integer >= 1, not {max_tokens!r}")
        tokens = check_token_ids(tokens, self.vocab)
        if len(tokens) + max_tokens > self.context:  # a session's history counts: it is in tokens
            raise UserError(f"prompt ({len(tokens)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                            f"context of {self.context} tokens")
        if caches is None:
            self.kv.check(len(tokens) + max_tokens)
        elif not 0 <= reused < len(tokens):
            raise ValueError("reused tokens must leave at least one token to prefill")
        sampling = sampling if sampling is not None else Sampling(**options)
        req = Request(self, next(self._ids), tokens, max_tokens, sampling, self.tokenizer, caches, reused, progress,
                      stats, on_done)
        with self.lock:
            self._settle()
            if self.scheduler.idle():
                self.runner.reset_peak()
            self.scheduler.add(req)
            self.consensus.submitted(req, announced)
        return req

    def cancel(self, req: Request):
        with self.lock:
            if req.state != DONE:
                self.consensus.cancelling(req)
                self._finish(req, "cancelled", publish=False)

    def use_peer(self, peer):
        """Agree answers and announce calls with the other ranks through `peer` (distributed/mirror.py)."""
        with self.lock:
            self.consensus.use(peer)

    def set_drafter(self, drafter, gate=None):
        """Drafter (and its gate) for the lone-request speculative mode; None turns it off."""
        with self.lock:
            self.drafter, self.gate = drafter, gate

    def settle(self):
        """Feed finished turns' last tokens into their caller-owned caches (done once their callers have read
        the last chunk, before the next step or submission, so those caches hold whole turns again); then
        each request's on_done. Announced like a step (it runs the model on caller-owned caches)."""
        with self.lock:
            if self._tails:
                self.consensus.settling(self)
            self._settle()

    def _settle(self):
        """settle() as part of a call already announced (a step, a submission, a cancel)."""
        with self.lock:
            tails, self._tails = self._tails, []
            for r, caches, ids in tails:
                self.runner.feed(caches, ids)
                r.settled()

    def executor(self):
        """The single worker thread async callers step the engine on (all of their MLX work on one thread)."""
        if self._executor is None:
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(1, thread_name_prefix="justfit-engine")
        return self._executor

    def idle(self) -> bool:
        return self.scheduler.idle()

    def run(self, requests: List[Request]) -> List[Generation]:
        """Step until every request is done; their Generations in order."""
        while not all(r.done for r in requests):
            self.step()
        return [r.result() for r in requests]

    # -- one step ----------------------------------------------------------------------------------
    def step(self) -> int:
        """Plan, run one forward pass (or a verify), take the tokens. Returns rows computed."""
        with self.lock:
            self.consensus.stepping(self)
            try:
                return self._step()
            except RuntimeError as e:
                self.consensus.failed(e)
                raise

    def _step(self) -> int:
        """step() under the lock: one pass and its tokens."""
        self._settle()
        lone, t0, waited = None, time.perf_counter(), False
        current = self._queued_pass()
        if current is None:
            self.scheduler.admit()
            lone = self.scheduler.lone() if self.drafter is not None else None
            if lone is not None and self._speculate(lone):
                return 1
            plan = self.scheduler.schedule()
            if not plan:
                return 0
            t0, waited = time.perf_counter(), True  # built and computed in this call (not queued before)
            current = self.runner.start(plan)
        plan, logits, greedy = current
        self._ahead = self._queue_next(plan, greedy)  # built while this pass computes
        greedy = greedy.tolist() if greedy is not None else None
        self.steps += 1
        now = time.perf_counter()
        if waited:
            self.scheduler.chunks.observe(sum(n for _, n in plan), now - t0)
        self._time_plain(plan, now - t0 if waited else None, now)
        for j, (r, n) in enumerate(plan):
            self.kv.publish_sealed(r, r.cached - n)
            if not r.left and greedy is not None:
                self._take(r, self.runner.pick(r, logits[j], greedy[j]), now)
        self._wait = self._drafter_waits(plan)
        if self.scheduler.idle():
            self.runner.enter("idle")
        return sum(n for _, n in plan)

    def _queued_pass(self) -> Optional[tuple]:
        """(plan, logits, argmax) of the pass the last step queued, without rows cancelled since; None if none."""
        import mlx.core as mx

        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        rows = [j for j, (r, _) in enumerate(ahead[0]) if r.state == RUNNING]
        if not rows:
            return None
        plan, logits, greedy = ahead
        if len(rows) < len(plan):  # a row was cancelled in between: its output is dropped
            plan = [plan[j] for j in rows]
            logits, greedy = logits[mx.array(rows)], greedy[mx.array(rows)]
        for r, n in plan:  # their tokens are in their caches since that pass was built
            r.computed(n)
        return plan, logits, greedy

    def _queue_next(self, plan: List[tuple], greedy) -> Optional[tuple]:
        """Queue the next decode-only pass on this pass's argmax when the scheduler allows it, no drafter is
        about to propose for a lone request, and the CPU kernel does not serve it (it computes while built:
        nothing to overlap). A row that stops at this token had one token too many fed: pages hold only
        what `cached` says (and a caller-owned cache keeps it: it is the turn's last token)."""
        if greedy is None or (self.drafter is not None and len(plan) == 1 and (self._wait or not self._cheap)):
            return None
        nxt = self.scheduler.decode_only_next(plan)
        if nxt is None or self.runner.computes_while_built(plan):
            return None
        return self.runner.queue(nxt, greedy)

    def _time_plain(self, plan: List[tuple], seconds: Optional[float], now: float):
        """What a plain lone decode step costs, for the drafting gate: the step's own time, or for steps
        queued ahead (overlapped) the time between their tokens."""
        if self.gate is None or self.drafter is None or len(plan) != 1 or plan[0][1] != 1:
            self._t_last = None
            return
        if seconds is None and self._t_last is not None:
            seconds = now - self._t_last
        if seconds is not None:
            self.gate.plain(seconds)
        self._t_last = now

    @property
    def _cheap(self) -> bool:
        """The drafter proposes without a model pass, so it can be asked after every token."""
        return bool(getattr(self.drafter, "cheap", False))

    def _drafter_waits(self, plan: List[tuple]) -> bool:
        """After a lone greedy request's plain step: will the drafter propose after its newest token? Then
        the next pass is not queued ahead, so the drafts can be verified (a cheap drafter's question costs
        nothing; an expensive one is asked by the verify pass itself)."""
        if self.drafter is None or len(plan) != 1 or not self._cheap:
            return False
        r = plan[0][0]
        if r.done or not r.sampling.plain_greedy or len(self.scheduler.running) != 1:
            return False
        follow(self.drafter, r.feed)
        return (self.gate is None or self.gate.open()) and bool(self.drafter.propose(1))

    def _speculate(self, r: Request) -> bool:
        """One draft + verify pass for the lone greedy request r; False: run a plain step instead."""
        if r.force_plain:
            r.force_plain = False
            return False
        before = dict(r.counts)
        res = self.runner.speculate(r, self.drafter, self.gate, self.eos)
        if res is None:
            return False
        out, pending = res
        for key in self.counts:
            self.counts[key] += r.counts[key] - before[key]
        self.steps += 1
        now = time.perf_counter()
        for t in out[1:] + ([pending] if pending is not None and out else []):
            if self._take(r, t, now):
                break
        return True

    def _take(self, r: Request, tok: int, now: float) -> bool:
        """r's next token: the Request emits it, or r finishes. True when r finished."""
        reason = r.accept(tok, self.eos, now)
        if reason is not None:
            self._finish(r, reason)
        return reason is not None

    def _finish(self, r: Request, reason: str, publish: bool = True):
        if r.given is not None and r.caches is not None:
            if self._ahead is not None and any(x is r for x, _ in self._ahead[0]):
                r.computed(1)  # the queued pass already fed its pending token (the argmax it took)
            # the turn's last tokens go in, so the next turn reuses them (cancelled: the ones it emitted);
            # after the caller has read the last token, so feeding them never delays it
            ids = r.ending() if reason != "cancelled" else r.emitted()
            r.computed(len(ids))
            self._tails.append((r, r.caches, ids))
        self.scheduler.remove(r)
        self.kv.release(r, publish)
        drafted = r.counts["draft_passes"] > 0
        r.close(reason, getattr(self.drafter, "name", "drafter") if drafted else None)
        r.stats.peak_memory_bytes = self.runner.peak()
        if r.given is None:
            r.settled()
        elif reason == "cancelled":
            self._settle()

    # -- reporting ---------------------------------------------------------------------------------
    def used_bytes(self) -> int:
        return self.kv.used_bytes()

    def report(self) -> Dict[str, int]:
        s = self.scheduler
        return {"queued": len(s.queue), "running": len(s.running), "steps": self.steps,
                "preempted": s.preempted, "kv_bytes": self.kv.used_bytes(),
                "budget_bytes": self.kv.budget_bytes or 0, **self.counts}


class AsyncRequest:
    """asyncio view of a Request: `async for chunk in req`, `await req.result()`, `req.cancel()`. Engine
    steps run on the engine's one worker thread, so the event loop never blocks on the model."""

    def __init__(self, request: Request):
        self.request = request

    def __aiter__(self):
        return self

    async def __anext__(self) -> Chunk:
        import asyncio

        chunk = await asyncio.get_running_loop().run_in_executor(self.request.engine.executor(), _next_or_none,
                                                                 self.request)
        if chunk is None:
            raise StopAsyncIteration
        return chunk

    async def result(self) -> Generation:
        import asyncio

        return await asyncio.get_running_loop().run_in_executor(self.request.engine.executor(),
                                                                self.request.result)

    def cancel(self):
        self.request.cancel()


def _next_or_none(req: Request) -> Optional[Chunk]:
    return next(req, None)
