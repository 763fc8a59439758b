"""Continuous batching: a queue of requests, admission under a KV memory budget, one batched forward pass
per step (decode tokens of running sequences plus prefill chunks under a per-step token budget), and
preemption through StateTrans when memory runs out.

Every request keeps one list `feed`: its prompt followed by the tokens it generated. Its sequence (paged
KV over the runtime's shared pool) holds `feed[:cached]`; each step feeds the next piece (a prefill chunk,
or the one token sampled last step) and, when that piece reaches the end of `feed`, samples the next
token from the piece's last row. Decode, chunked prefill, forced grammar tokens and resuming a preempted
request are the same operation. Prefixes are shared through the runtime's prefix index (statetrans): a
request whose prefix another admitted request is still computing waits for its pages instead of
prefilling them twice. Sampling and stop strings are generation.py's (`Sampling`, `StopText`). While every
running request decodes greedily, each step queues the next pass on its argmax before reading it, so
building the graph overlaps the computation (mlx-lm's loops do the same).
"""

import itertools
import threading
import time
from collections import deque
from typing import Callable, Dict, List, Optional

from .errors import MemoryBudgetError, UserError
from .generation import Sampling, StopText
from .models.vocab import check_token_ids, vocab_size
from .scheduler_chunks import ChunkSizer
from .scheduler_memory import KVBytes
from .statetrans.index import common_prefix
from .turns import Chunk, Generation, Submitted, TurnStats

STEP_TOKENS = 512  # rows of one forward pass: decoders first, prefill chunks fill the rest
# Prefill rows in a step that also decodes. Each such row delays every decoder (~6.4 ms a row on the 2-core
# CPU: 500 rows ~3.3 s vs a decode-only step ~0.1 s), and each step has ~0.1 s of fixed cost, so small
# chunks slow prefill. Test model, c=8 x 512-token prompts, loaded CPU (cap: wall s, ITL p50/p99 s, TTFT
# p50/max s): none: 39.1, 0.40/3.92, 22.1/30.6; 64: 40.9, 0.55/1.40, 22.1/36.8; 128: 36.1, 0.87/1.27,
# 19.0/31.4. 128 bounds the stall without costing prefill throughput; 64 shortens steps to ~0.55 s but
# delays the last first token ~20%. Nobody decoding: all STEP_TOKENS prefill (a lone TTFT is unchanged).
# This is the floor: a model whose steps cost much beside their rows gets more (scheduler_chunks.py).
PREFILL_WITH_DECODE = 128
MAX_BATCH = 64  # sequences running at once
QUEUED, WAITING, RUNNING, DONE = "queued", "waiting", "running", "done"


class Request(Submitted):
    """One submitted generation: iterate it for Chunks (this drives the engine), `cancel()` to stop it."""

    def __init__(self, engine: "Engine", rid: int, prompt: List[int], max_tokens: int, sampling: Sampling):
        self.engine, self.id, self.prompt = engine, rid, list(prompt)
        self.max_tokens, self.sampling = max_tokens, sampling
        self.feed: List[int] = list(prompt)  # prompt + generated tokens (what the KV must hold, in order)
        self.out: List[int] = []  # generated tokens
        self.caches: Optional[list] = None  # per-layer paged caches while admitted
        self.cached = 0  # feed[:cached] is in the caches
        self.high = 0  # the most tokens the caches ever held (before a preemption)
        self.state, self.finish_reason = QUEUED, None
        self.chunks: deque = deque()
        self.text: List[str] = []
        self.stats = TurnStats(prompt_tokens=len(prompt))
        self.submitted = self.admitted = time.perf_counter()
        self.token_times: List[float] = []
        self.preemptions = 0
        self.force_plain = False  # a verify pass hit a near-tie: the next decode is a plain step
        self.counts: dict = {}  # speculative passes: draft_passes, drafted_tokens, accepted_tokens
        self.restored_tokens = 0  # after preemptions: tokens whose pages came back instead of recomputed
        self._detok = engine.tokenizer.detokenizer
        self._stops = StopText(sampling.stop)
        self._sample = sampling.sampler()
        self._processors = sampling.processors()


    # -- engine side -------------------------------------------------------------------------------
    def _emit(self, text: str, token: int):
        if text or token >= 0:
            self.text.append(text)
            self.chunks.append(Chunk(text, token))


class Engine:
    """The step loop over one model and one page pool; fronts (Runtime.submit, the server) submit to it."""

    def __init__(self, model, tokenizer, make_cache: Callable[[], list], index=None, kv=None,
                 budget_bytes: Optional[int] = None, step_tokens: int = STEP_TOKENS, max_batch: int = MAX_BATCH,
                 context: Optional[int] = None, residency=None, eos: Optional[set] = None, drafter=None,
                 gate=None, prefill_with_decode: Optional[int] = None):
        self.model, self.tokenizer, self.make_cache, self.index = model, tokenizer, make_cache, index
        self.drafter, self.gate = drafter, gate  # a lone plain-greedy request decodes speculatively
        self.counts = {"draft_passes": 0, "drafted_tokens": 0, "accepted_tokens": 0}
        self.kv, self.budget_bytes = kv, budget_bytes
        self.step_tokens, self.max_batch, self.residency = step_tokens, max_batch, residency
        if prefill_with_decode is not None and prefill_with_decode < 1:
            raise UserError(f"prefill_with_decode must be >= 1 row, not {prefill_with_decode}")
        # prefill rows of a step that also decodes: as given, or at least PREFILL_WITH_DECODE and more on a model
        # whose steps cost much beside their rows (scheduler_chunks.py)
        self.chunks = ChunkSizer(prefill_with_decode or PREFILL_WITH_DECODE, step_tokens, prefill_with_decode is None)
        args = getattr(model, "args", None)
        self.context = context or getattr(args, "max_position_embeddings", None) or 1 << 20
        self.vocab = vocab_size(model)
        self.eos = set(getattr(tokenizer, "eos_token_ids", ()) or ()) if eos is None else set(eos)  # stop ids
        self.queue: deque = deque()  # QUEUED / WAITING requests, oldest first (preempted ones at the front)
        self.running: List[Request] = []  # admitted, oldest first
        self.lock = threading.RLock()
        self.steps = 0
        self.preempted = 0
        self._ids = itertools.count()
        self.kv_bytes = KVBytes(model, kv) if kv is not None else None  # None: no KV arithmetic (0 bytes)
        self._executor = None
        self._stacks: dict = {}  # batched decode: stacked sealed pages reused across steps (kvexec/batch.py)
        self._ahead: Optional[tuple] = None  # (plan, logits, argmax) of the next step, queued early (_queue_next)
        self.pool = index.pool if index is not None else None  # set from the first cache otherwise

    # -- requests ----------------------------------------------------------------------------------
    def submit(self, tokens: List[int], max_tokens: int = 256, **sampling) -> Request:
        """Queue a request; bad requests raise UserError here and never touch the running batch."""
        tokens = list(tokens)
        if not tokens:
            raise UserError("the prompt is empty: give at least one token")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise UserError(f"max_tokens must be an integer >= 1, not {max_tokens!r}")
        tokens = check_token_ids(tokens, self.vocab)
        if len(tokens) + max_tokens > self.context:
            raise UserError(f"prompt ({len(tokens)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                            f"context of {self.context} tokens")
        need = self._worst_bytes(len(tokens) + max_tokens)
        if self.budget_bytes is not None and need > self.budget_bytes:
            raise MemoryBudgetError(f"one request of {len(tokens) + max_tokens} tokens needs {need} bytes of KV, "
                                    f"more than the budget of {self.budget_bytes}")
        req = Request(self, next(self._ids), tokens, max_tokens, Sampling(**sampling))
        with self.lock:
            self.queue.append(req)
        return req

    def cancel(self, req: Request):
        with self.lock:
            if req.state == DONE:
                return
            if req in self.queue:
                self.queue.remove(req)
            self._finish(req, "cancelled", publish=False)

    def set_drafter(self, drafter, gate=None):
        """Drafter (and its gate) for the lone-request speculative mode; None turns it off."""
        with self.lock:
            self.drafter, self.gate = drafter, gate

    def executor(self):
        """The single worker thread async callers step the engine on (all of their MLX work on one thread)."""
        if self._executor is None:
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(1, thread_name_prefix="justfit-engine")
        return self._executor

    def idle(self) -> bool:
        return not self.queue and not self.running

    def run(self, requests: List[Request]) -> List[Generation]:
        """Step until every request is done; their Generations in order."""
        while not all(r.done for r in requests):
            self.step()
        return [r.result() for r in requests]

    # -- one step ----------------------------------------------------------------------------------
    def step(self) -> int:
        """Admit, assemble and run one batched forward pass, sample, emit. Returns rows computed."""
        with self.lock:
            lone, t0, waited = None, time.perf_counter(), False
            current = self._queued_pass()
            if current is None:
                self._admit()
                lone = self._lone_speculative()
                if lone is not None and self._speculate(lone):
                    return 1
                plan = self._assemble()
                if not plan:
                    return 0
                if self.residency is not None:
                    self.residency.enter("decode")
                t0, waited = time.perf_counter(), True  # built and computed in this call (not queued before)
                current = self._run_pass(plan)
            plan, logits, greedy = current
            nxt = self._queue_next(plan, greedy)  # built while this pass computes
            greedy = greedy.tolist()
            self.steps += 1
            now = time.perf_counter()
            if waited:
                self.chunks.observe(sum(n for _, n in plan), now - t0)
            if lone is not None and self.gate is not None and plan == [(lone, 1)]:
                self.gate.plain(now - t0)  # what a plain step costs, for the drafting gate
            for j, (r, n) in enumerate(plan):
                self._publish_sealed(r, r.cached - n)
                if r.cached == len(r.feed):
                    self._take(r, self._choose(r, logits[j], greedy[j]), now)
            self._ahead = nxt
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
            r.cached += n
            r.high = max(r.high, r.cached)
        return plan, logits, greedy

    def _run_pass(self, plan: List[tuple]) -> tuple:
        """Build and start one forward pass over `plan`: (plan, logits, argmax), evaluating asynchronously."""
        import mlx.core as mx

        ids = [t for r, n in plan for t in r.feed[r.cached:r.cached + n]]
        logits = self._forward(plan, ids)
        for r, n in plan:
            first_time = max(0, r.cached + n - max(len(r.prompt), r.high, r.cached))  # generated ids fed once
            r.stats.prefilled_tokens += n - first_time  # prompt rows and recomputed rows, not decode rows
            r.cached += n
            r.high = max(r.high, r.cached)
        greedy = mx.argmax(logits, axis=-1)  # every plain greedy row's token, in the same evaluation
        mx.async_eval(logits, greedy, *[c.state for r, _ in plan if r.cached < len(r.feed) for c in r.caches])
        return plan, logits, greedy

    def _queue_next(self, plan: List[tuple], greedy) -> Optional[tuple]:
        """When every running request is a plain greedy decoder with tokens left and nobody waits, queue the
        next step's pass on this step's argmax before reading it (as mlx-lm's generate loop does): building
        the graph overlaps the computation. A row that stops at this token had one token too many fed; its
        sequence is released (pages hold only what `cached` says). Not where the CPU kernel serves the pass:
        it computes while built, so this step's tokens would be published a step late for no overlap."""
        import mlx.core as mx

        from .kvexec import kernel_serves

        if self.queue or len(plan) != len(self.running) or (self.drafter is not None and len(plan) == 1):
            return None  # someone to admit, a prefill to finish, or a lone request that drafts instead
        if kernel_serves([r.caches[0] for r, _ in plan]):
            return None
        for r, _ in plan:
            if r.cached != len(r.feed) or not r.sampling.plain_greedy or len(r.out) + 2 > r.max_tokens:
                return None
        nxt = [(r, 1) for r, _ in plan]
        if not self._fits(sum(self._grow_bytes(r, 1) for r, _ in nxt)):
            return None
        for r, _ in nxt:
            r.caches[0].seq.reserve(r.cached + 1)
        logits = self._forward(nxt, greedy)
        greedy = mx.argmax(logits, axis=-1)
        mx.async_eval(logits, greedy)
        return nxt, logits, greedy

    def _forward(self, plan: List[tuple], ids):
        """Logits [len(plan), vocab] at each request's last row; ids: a list, or the last step's argmax
        array (a queued step, _queue_next). A lone decode row runs mlx-lm's
        single-sequence call on its own caches: at c=1 that is the plain token loop (4-13 ms/step less on
        the 2-core CPU than the batched pass, whose decode attention stacks a padded page run every step)."""
        import mlx.core as mx

        from .kvexec.batch import BatchPlan, forward

        if len(plan) == 1 and plan[0][1] == 1:
            logits = self.model(mx.array(ids).reshape(1, 1), cache=plan[0][0].caches)[:, -1]
            if self.budget_bytes is not None and self.used_bytes() > self.budget_bytes:
                self._drop_copies()  # its decode memo does not fit beside the pages: workspace of this step only
            return logits
        return forward(self.model, BatchPlan([(r.caches, n) for r, n in plan], *self._memo(plan)), ids)

    def _memo(self, plan: List[tuple]) -> tuple:
        """(the stacked sealed pages to keep between steps, or None and none kept; whether they may hold 4-bit
        pages dequantized): the stacks are a speed cache, one more copy of the decoders' sealed pages, each
        padded to the longest decoder's, so the budget counts them (see used_bytes). Float32 copies of every
        sealed page (dequantized 4-bit ones: kvexec/batch.py DEQUANT_TOKENS) when the budget holds them, else
        copies in the stored format (16-bit floats widened: at most 2x stored)."""
        from .kvexec.batch import drop_decoded

        if self.budget_bytes is None or self.kv_bytes is None:
            return self._stacks, True
        P = self.kv.page_size
        decoders = [r for r, n in plan if n == 1]  # rows batched decode reads through the stacks
        longest = max(((r.cached + 1) // P * P for r in decoders), default=0)  # sealed pages during the pass
        floats = len(decoders) * (longest // P) * 2 * self.kv_bytes.open  # float32: twice a 16-bit page
        stored = 2 * len(decoders) * self.kv_bytes.seq(longest)
        if self.pool.nbytes + floats <= self.budget_bytes:
            return self._stacks, True
        if self.pool.nbytes + stored <= self.budget_bytes:
            drop_decoded(self._stacks)  # float copies out now, before stored-format ones come in
            return self._stacks, False
        self._drop_copies()
        return None, False

    def _publish_sealed(self, r: Request, before: int):
        """Index pages r sealed since it held `before` tokens, so followers attach them now."""
        if self.index is None or r.caches is None:
            return
        P = r.caches[0].seq.page_size
        if before // P < r.cached // P:
            self.index.publish(r.caches[0].seq, r.feed[:r.cached // P * P])  # sealed pages only

    # -- speculative decoding of a lone request --------------------------------------------------
    def _lone_speculative(self) -> Optional[Request]:
        """The request to decode speculatively: the only one running, decoding, plain greedy (else None)."""
        if self.drafter is None or len(self.running) != 1:
            return None
        r = self.running[0]
        if not _decoding(r) or not r.sampling.plain_greedy:
            return None
        return r

    def _speculate(self, r: Request) -> bool:
        """Draft after r's pending token and verify the drafts in one pass over r's own pages (generation's
        `speculate`; rejected drafts are trimmed from those pages, nothing moves). False: run a plain step."""
        from .generation import speculate

        if r.force_plain:
            r.force_plain = False
            return False
        room = r.max_tokens - len(r.out)
        if room < 1 or not self._fits(self._grow_bytes(r, min(room, 8) + 1)):
            return False
        h = self.drafter.hist
        if h and len(h) <= len(r.feed) and r.feed[:len(h)] == h:
            self.drafter.extend(r.feed[len(h):])
        else:
            self.drafter.reset(list(r.feed))
        enter = self.residency.enter if self.residency is not None else _no_phase
        before = dict(r.counts)
        res = speculate(self.model, r.caches, r.feed[-1], self.drafter, self.gate, room, self.eos, r.counts, enter)
        if res is None:
            return False
        out, pending, r.force_plain = res
        for key in self.counts:
            self.counts[key] += r.counts.get(key, 0) - before.get(key, 0)
        self._spec_stats(r)
        self.steps += 1
        start, r.cached = r.cached, r.cached + len(out)
        r.high = max(r.high, r.cached)
        self._publish_sealed(r, start)
        now = time.perf_counter()
        for t in out[1:] + ([pending] if pending is not None and out else []):
            if self._take(r, t, now):
                break
        return True

    def _spec_stats(self, r: Request):
        s, c = r.stats, r.counts
        s.drafter = getattr(self.drafter, "name", "drafter")
        s.draft_passes, s.drafted_tokens = c.get("draft_passes", 0), c.get("drafted_tokens", 0)
        s.accepted_tokens = c.get("accepted_tokens", 0)
        s.acceptance = s.accepted_tokens / s.drafted_tokens if s.drafted_tokens else 0.0

    def _choose(self, r: Request, logits, greedy: int) -> int:
        """Sampling of one row: the same processors, constraint and sampler as the single-sequence path
        (generation.Sampling); `greedy` is the row's argmax, used as is when nothing rewrites the logits."""
        import mlx.core as mx

        if r.sampling.temperature == 0 and r.sampling.constraint is None and not r._processors:
            return greedy
        logits = logits[None]  # [1, vocab], the shape generation.py's processors and constraints get
        if r._processors:
            ctx = mx.array(r.feed)
            for p in r._processors:
                logits = p(ctx, logits)
        if r.sampling.constraint is not None:
            logits = r.sampling.constraint.apply(logits)
        if r.sampling.temperature == 0 and r.sampling.constraint is None:
            return int(mx.argmax(logits))
        if r.sampling.seed is not None:  # reproducible per request whatever else shares the batch
            mx.random.seed((r.sampling.seed * 1_000_003 + len(r.out)) % 2**63)
        return int(r._sample(logits - mx.logsumexp(logits, axis=-1, keepdims=True))[0])

    def _take(self, r: Request, tok: int, now: float) -> bool:
        """r's next token: emit it (and any tokens its grammar forces), or finish r. True when r finished."""
        if not r.out:
            r.stats.ttft_s = r.stats.prefill_s = now - r.submitted
        r.token_times.append(now)
        c = r.sampling.constraint
        if c is not None:
            c.advance(tok)
        if tok in self.eos:
            self._finish(r, "stop")
            return True
        r.out.append(tok)
        r.feed.append(tok)
        r.stats.generated_tokens = len(r.out)
        r._detok.add_token(tok)
        text = r._stops.feed(r._detok.last_segment)
        r._emit(text, tok)
        if r._stops.hit or (c is not None and c.done):
            self._finish(r, "stop")
            return True
        if len(r.out) >= r.max_tokens:
            self._finish(r, "length")
            return True
        if c is not None:
            forced = c.forced()[: r.max_tokens - len(r.out)]
            for t in forced:  # forced() already moved the grammar past them
                r.out.append(t)
                r.feed.append(t)
                r._detok.add_token(t)
                r._emit(r._stops.feed(r._detok.last_segment), t)
            r.stats.forced_tokens += len(forced)
            r.stats.generated_tokens = len(r.out)
            if forced and (c.done or len(r.out) >= r.max_tokens):  # as generation.py: nothing left to sample
                self._finish(r, "stop" if c.done else "length")
                return True
        return False

    def _finish(self, r: Request, reason: str, publish: bool = True):
        if r in self.running:
            self.running.remove(r)
        if not self.running:
            self._stacks.clear()  # nothing decodes now: give the stacked copies back
        if r.caches is not None:
            seq = r.caches[0].seq
            if publish and self.index is not None:
                self.index.publish(seq, r.feed[:r.cached])
            seq.release()
            r.caches = None
        if reason != "cancelled":
            r._detok.finalize()
            tail = r._stops.feed(r._detok.last_segment) if not r._stops.hit else ""
            tail += "" if r._stops.hit else r._stops.flush()
            r._emit(tail, -1)
        r.state, r.finish_reason = DONE, reason
        s = r.stats
        s.finish_reason = reason
        s.turn_s = time.perf_counter() - r.submitted
        if len(r.token_times) > 1:
            s.decode_tok_s = (len(r.token_times) - 1) / (r.token_times[-1] - r.token_times[0])

    # -- admission and memory ----------------------------------------------------------------------
    def _admit(self):
        """Move queued requests into the running set while batch room and KV budget allow (oldest first)."""
        for r in list(self.queue):
            if len(self.running) >= self.max_batch:
                return
            r.caches = self.make_cache()
            seq = r.caches[0].seq
            self.pool = seq.pool
            reused = self.index.extend(seq, r.feed, limit=len(r.feed) - 1) if self.index is not None else 0
            if self._leader(r, reused) is not None:  # its prefix is being computed: attach it when sealed
                seq.release()
                r.caches, r.state = None, WAITING
                continue
            need = self._seq_bytes(len(r.feed)) - self._seq_bytes(reused) + self._headroom()
            if not self._fits(need) and self.running:
                seq.release()
                r.caches = None
                return  # oldest first: nobody overtakes a request waiting for memory
            self.queue.remove(r)
            r.cached = reused
            if not r.preemptions:
                r.stats.reused_tokens = reused
                r.stats.queue_s = time.perf_counter() - r.submitted
            else:
                r.restored_tokens += reused  # pages checkpointed at preemption, attached again
            r.state = RUNNING
            self.running.append(r)
            if len(self.running) > 1 or self.queue:  # company now, or waiting: every running sequence is batched
                self._batched([c for x in self.running for c in x.caches])

    def _leader(self, r: Request, reused: int) -> Optional[Request]:
        """A running request still computing a full page r shares beyond what r could attach."""
        if self.index is None:
            return None
        P = self.index.page_size
        for a in self.running:
            common = common_prefix(a.feed, r.feed, len(r.feed) - 1) // P * P
            if common > reused and a.cached < common:
                return a
        return None

    def _assemble(self) -> List[tuple]:
        """[(request, rows)] for this step: every decoder one token, then prefill chunks oldest first, within
        step_tokens and, while anyone decodes, within prefill_with_decode rows (a long prefill must not
        stall the decoders); preempts the youngest when the KV budget cannot hold the step."""
        while True:
            plan = [(r, 1) for r in self.running if _decoding(r)]
            budget = self.step_tokens - len(plan)
            if plan:
                budget = min(budget, self.chunks.rows())
            for r in self.running:
                left = len(r.feed) - r.cached
                if left and budget > 0 and not _decoding(r):
                    plan.append((r, min(left, budget)))
                    budget -= plan[-1][1]
            if not plan:
                return plan
            need = sum(self._grow_bytes(r, n) for r, n in plan)
            if self._fits(need) or len(self.running) == 1:
                for r, n in plan:
                    r.caches[0].seq.reserve(r.cached + n)  # all layers at once, before the pass
                return plan
            self._preempt(self.running[-1])

    def _preempt(self, r: Request):
        """Checkpoint r's sealed pages through StateTrans, release its sequence, requeue it at the front;
        on readmission the pages come back from the index (memory or disk) and only the open page is recomputed."""
        from .statetrans.checkpoint import commit

        seq = r.caches[0].seq
        if self.index is not None:
            published = self.index.publish(seq, r.feed[:r.cached])
            if self.index.persist:
                try:
                    commit(self.index.store, self.index.home, None, self.index.new_pages(published),
                           self.index.checksums)
                except OSError:
                    pass  # stays in memory only; if evicted there, its tokens are recomputed
        seq.release()
        self._drop_copies()  # memory is short: stacked copies of sealed pages go too
        r.caches, r.cached, r.state = None, 0, QUEUED
        r.preemptions += 1
        self.preempted += 1
        self.running.remove(r)
        self.queue.appendleft(r)
        if self.index is not None and self.budget_bytes is not None:
            self.index.evict_memory(self.budget_bytes // 2)

    def used_bytes(self) -> int:
        """Bytes of every page in the pool (running sequences' and cached prefixes') plus the stacked copies
        of sealed pages decode keeps between steps: batched decode's, and each sequence's own decode memo
        (kvexec/decode.py, filled while it decodes alone), and a lone sequence's float-window copies."""
        from .kvexec.batch import memo_nbytes

        pool = self.pool.nbytes if self.pool is not None else 0
        solo = sum(c.window_nbytes for c in self._solo_caches())
        return pool + memo_nbytes(self._stacks) + sum(c.memo.nbytes for c in self._memo_caches()) + solo

    def _memo_caches(self):
        """Running sequences' layer caches that hold a decode memo (stacked pages, or the CPU kernel's page list)."""
        return [c for r in self.running if r.caches for c in r.caches
                if getattr(c, "memo", None) and (c.memo.runs or c.memo.table is not None)]

    def _solo_caches(self):
        """Layer caches of a lone running sequence still in single-sequence mode (float window, float32 open page)."""
        return [c for r in self.running if r.caches for c in r.caches if getattr(c, "batched", True) is False]

    def _drop_copies(self, need: int = 0):
        """Free what is only a speed cache, cheapest to rebuild first: stacked sealed pages and decode memos
        (the next step rebuilds what it reads); then, if `need` more bytes still pass the budget, a lone
        sequence's float window (it runs batched from here on)."""
        self._stacks.clear()
        for c in self._memo_caches():
            c.drop_memo()
        if self.budget_bytes is not None and self.used_bytes() + need > self.budget_bytes:
            self._batched(self._solo_caches())

    @staticmethod
    def _batched(caches):
        """Switch caches to batched serving (kvexec/cache.py for_batch): no float window, whose copies and reads
        cost ~14 MB of peak per sequence (bench batch), and 16-bit open pages (capacity). A request admitted
        alone keeps single-sequence mode, as fast as `justfit chat`'s path, until a second one runs beside it."""
        from .kvexec import PagedKVCache

        for c in caches:
            if isinstance(c, PagedKVCache) and not c.batched:
                c.for_batch()

    def _fits(self, need: int) -> bool:
        """True when `need` more bytes fit the budget, after dropping what is only a speed cache (stacked page
        copies) and cold cached prefixes, in that order."""
        if self.budget_bytes is None:
            return True
        if self.used_bytes() + need <= self.budget_bytes:
            return True
        self._drop_copies(need)  # speed copies go first: one step rebuilds them
        if self.used_bytes() + need <= self.budget_bytes:
            return True
        if self.index is not None:  # cold cached prefixes go first
            self.index.evict_memory(max(0, self.budget_bytes - need))
        return self.used_bytes() + need <= self.budget_bytes

    def _grow_bytes(self, r: Request, n: int) -> int:
        """Bytes r's pages grow by when n more tokens are written after its cached ones."""
        return self.kv_bytes.grow(r.cached, n) if self.kv_bytes is not None else 0

    def _headroom(self) -> int:
        """Room kept free at admission: one more page for every running sequence, so admitting a request
        does not force a preemption a few steps later (no admit/preempt thrashing)."""
        if self.kv_bytes is None:
            return 0
        return sum(self.kv_bytes.grow(len(r.feed), self.kv.page_size) for r in self.running)

    def _seq_bytes(self, n_tokens: int) -> int:
        """KV bytes of a sequence of n_tokens (scheduler_memory.KVBytes; bench/batch.py reads it too)."""
        return self.kv_bytes.seq(n_tokens) if self.kv_bytes is not None else 0

    def _worst_bytes(self, n_tokens: int) -> int:
        """KV bytes one request of n_tokens can reach."""
        return self.kv_bytes.worst(n_tokens) if self.kv_bytes is not None else 0

    # -- reporting ---------------------------------------------------------------------------------
    def report(self) -> Dict[str, int]:
        return {"queued": len(self.queue), "running": len(self.running), "steps": self.steps,
                "preempted": self.preempted, "kv_bytes": self.used_bytes(),
                "budget_bytes": self.budget_bytes or 0, **self.counts}


def _decoding(r: Request) -> bool:
    """r's next row is the token it sampled last (a decode row; a prompt's last row is prefill)."""
    return len(r.feed) - r.cached == 1 and bool(r.out)


def _no_phase(*args, **kwargs) -> float:
    return 0.0


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
