"""Policy only: which requests run, and what each computes in the next step.

`schedule()` returns a plan, [(request, rows)]: every decoder one row, then prefill chunks oldest first
within the step's rows and, while anyone decodes, within the chunk cap (a long prefill must never stall the
decoders for more than one chunk a step). Admission is oldest first under the batch size and the KV
budget; when a step does not fit, the youngest running request is preempted. Every byte question goes to
the KV manager passed in (`kv`), so this module never touches MLX and is tested with a fake one.
"""

import time
from collections import deque
from typing import List, Optional

from ..statetrans.index import common_prefix
from .chunks import ChunkSizer
from .request import QUEUED, RUNNING, WAITING, Request

STEP_TOKENS = 512  # rows of one forward pass: decoders first, prefill chunks fill the rest
# Prefill rows in a step that also decodes, at least: each such row delays every decoder, and each step
# has a fixed cost, so smaller chunks slow prefill while larger ones stall decoders longer. A model whose
# steps cost much beside their rows gets more (chunks.py). Nobody decoding: all STEP_TOKENS prefill.
PREFILL_WITH_DECODE = 128
MAX_BATCH = 64  # sequences running at once
PREFILL_STEP = 2048  # a lone request's prefill chunk (nobody to stall): the decoder stack only, no LM head
ONE_PASS = 256  # a lone prompt of at most this many new tokens runs as one pass, LM head included
PROGRESS_STEP = 512  # the chunk of a lone prefill someone watches (a progress bar): progress every chunk


def lone_chunk(left: int, span: int, step: int = PREFILL_STEP) -> int:
    """Rows of a lone request's next prefill chunk, `left` of a prefill of `span` new tokens: a short one (a
    chat turn on a cached history) in one pass (runner.last_logits sends only its last row through the LM
    head where the model allows; elsewhere the head over <= ONE_PASS rows still costs less than a second
    pass through every layer); a longer one in `step`-row chunks of the decoder stack, then its last token
    alone (the loop of mlx-lm's generate_step)."""
    if span <= ONE_PASS:
        return left
    return min(step, left - 1) if left > 1 else 1


class Scheduler:
    """The waiting queue and the running set, and the decisions over them."""

    def __init__(self, kv, step_tokens: int = STEP_TOKENS, max_batch: int = MAX_BATCH,
                 prefill_with_decode: Optional[int] = None, consensus=None):
        self.kv = kv  # the KV manager: attach/detach, fits, grow/seq bytes, reserve, preempt, batched mode
        self.step_tokens, self.max_batch = step_tokens, max_batch
        self.chunks = ChunkSizer(prefill_with_decode or PREFILL_WITH_DECODE, step_tokens, prefill_with_decode is None,
                                 consensus)
        self.queue: deque = deque()  # QUEUED / WAITING requests, oldest first (preempted ones at the front)
        self.running: List[Request] = []  # admitted, oldest first
        self.preempted = 0

    def add(self, r: Request):
        self.queue.append(r)

    def remove(self, r: Request):
        """Forget r wherever it is (cancelled or finished); its caches are the KV manager's to release."""
        if r in self.queue:
            self.queue.remove(r)
        if r in self.running:
            self.running.remove(r)

    def idle(self) -> bool:
        return not self.queue and not self.running

    def lone(self) -> Optional[Request]:
        """The only running request when it decodes plain greedy (the one a drafter may speed up), else None."""
        if len(self.running) != 1:
            return None
        r = self.running[0]
        return r if r.decoding and r.sampling.plain_greedy else None

    # -- admission ---------------------------------------------------------------------------------
    def admit(self):
        """Move queued requests into the running set while batch room and KV budget allow (oldest first)."""
        for r in list(self.queue):
            if len(self.running) >= self.max_batch:
                return
            reused = self.kv.attach(r)
            if self._leader(r, reused) is not None:  # its prefix is being computed: attach it when sealed
                self.kv.detach(r)
                r.state = WAITING
                continue
            need = self.kv.seq_bytes(len(r.feed)) - self.kv.seq_bytes(reused) + self._headroom()
            if not self.kv.fits(need) and self.running:
                self.kv.detach(r)
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
                self.kv.batched(self.running)

    def _leader(self, r: Request, reused: int) -> Optional[Request]:
        """A running request still computing a full page r shares beyond what r could attach."""
        P = self.kv.page_size
        if P is None:
            return None
        for a in self.running:
            common = common_prefix(a.feed, r.feed, len(r.feed) - 1) // P * P
            if common > reused and a.cached < common:
                return a
        return None

    def _headroom(self) -> int:
        """Room kept free at admission: one more page for every running sequence, so admitting a request
        does not force a preemption a few steps later (no admit/preempt thrashing)."""
        return sum(self.kv.grow_bytes(len(r.feed), self.kv.page_size or 0) for r in self.running)

    # -- one step ----------------------------------------------------------------------------------
    def schedule(self) -> List[tuple]:
        """[(request, rows)] for this step over the running set (admit first), with the rows reserved in the KV;
        preempts the youngest while the budget cannot hold the step (a lone request always runs)."""
        while True:
            plan = [(r, 1) for r in self.running if r.decoding]
            budget = self.step_tokens - len(plan)
            if plan:
                budget = min(budget, self.chunks.rows())
            alone = len(self.running) == 1 and not self.queue
            for r in self.running:
                if r.left and budget > 0 and not r.decoding:
                    step = PREFILL_STEP if r.progress is None else PROGRESS_STEP
                    plan.append((r, lone_chunk(r.left, len(r.prompt) - r.stats.reused_tokens, step) if alone
                                 else min(r.left, budget)))
                    budget -= plan[-1][1]
            if not plan:
                return plan
            need = sum(self.kv.grow_bytes(r.cached, n) for r, n in plan)
            victim = next((r for r in reversed(self.running) if r.preemptible), None)
            if self.kv.fits(need) or len(self.running) == 1 or victim is None:
                self.kv.reserve(plan)
                return plan
            self.preempt(victim)

    def decode_only_next(self, plan: List[tuple]) -> Optional[List[tuple]]:
        """The next step's plan when it can be queued before this step's tokens are read: every running
        request a plain greedy decoder with tokens left, nobody waiting, and its rows fit; else None."""
        if self.queue or len(plan) != len(self.running):
            return None
        for r, _ in plan:
            if r.left != 0 or not r.sampling.plain_greedy or len(r.out) + 2 > r.max_tokens:
                return None
        nxt = [(r, 1) for r, _ in plan]
        if not self.kv.fits(sum(self.kv.grow_bytes(r.cached, 1) for r, _ in nxt)):
            return None
        return nxt

    def preempt(self, r: Request):
        """Checkpoint r's sealed pages and release them (the KV manager), requeue r at the front; on
        readmission its pages come back from the prefix index and only the open page is recomputed."""
        self.kv.preempt(r)
        r.cached, r.state = 0, QUEUED
        r.preemptions += 1
        self.preempted += 1
        self.running.remove(r)
        self.queue.appendleft(r)
