"""A Request: one generation's own state, from submission to its last chunk.

It owns its prompt ids and the tokens it generated (`feed`, what its KV must hold, in order), how many of
them are computed (`cached`), its status, its Chooser and stop text, its detokenizer and its own TurnStats.
The engine core moves it through its states; the KV side attaches and releases its caches; nobody else
writes its fields. Iterating it yields Chunks (each miss steps the engine).
"""

import time
from collections import deque
from typing import Callable, List, Optional

from ..turns import Chunk, Submitted, TurnStats
from .sampling import Chooser, Sampling, StopText

QUEUED, WAITING, RUNNING, DONE = "queued", "waiting", "running", "done"


class Request(Submitted):
    """One submitted generation: iterate it for Chunks (this drives the engine), `cancel()` to stop it."""

    def __init__(self, engine, rid: int, prompt: List[int], max_tokens: int, sampling: Sampling, tokenizer,
                 caches: Optional[list] = None, reused: int = 0, progress: Optional[Callable] = None,
                 stats: Optional[TurnStats] = None, on_done: Optional[Callable] = None):
        self.engine, self.id, self.prompt = engine, rid, list(prompt)
        self.max_tokens, self.sampling = max_tokens, sampling
        self.feed: List[int] = list(prompt)  # prompt + generated tokens (what the KV must hold, in order)
        self.out: List[int] = []  # generated tokens
        self.caches: Optional[list] = None  # per-layer paged caches while admitted
        self.given = caches  # caller-owned caches (a session's, a prefix lookup's): attached as is, never released
        self.reused = reused  # how many prompt tokens `given` already holds
        self.progress = progress  # progress(done, total) after each prefill chunk
        self.on_done = on_done  # on_done(request) once finished and its caches hold the turn (a session's end)
        self.failure: Optional[BaseException] = None  # what on_done raised, for the caller
        self.end: Optional[int] = None  # the end-of-turn id that finished it (never emitted)
        self.cached = 0  # feed[:cached] is in the caches
        self.high = 0  # the most tokens the caches ever held (before a preemption)
        self.state, self.finish_reason = QUEUED, None
        self.chunks: deque = deque()
        self.text: List[str] = []
        self.stats = stats if stats is not None else TurnStats()  # the caller's own record when given
        self.stats.prompt_tokens = len(prompt)
        self.submitted = time.perf_counter()
        self.token_times: List[float] = []
        self.preemptions = 0
        self.force_plain = False  # a verify pass hit a near-tie: the next decode is a plain step
        self.counts = {"draft_passes": 0, "drafted_tokens": 0, "accepted_tokens": 0}
        self.restored_tokens = 0  # after preemptions: tokens whose pages came back instead of recomputed
        self.chooser = Chooser(sampling)
        self._detok = tokenizer.detokenizer
        self._stops = StopText(sampling.stop)

    @property
    def preemptible(self) -> bool:
        """Its caches are the engine's to release (caller-owned ones never are)."""
        return self.given is None

    def held(self) -> List[int]:
        """The generated ids (an end-of-turn id included) the caches hold."""
        return self.feed[len(self.prompt):self.cached]

    def ending(self) -> List[int]:
        """Tokens still to feed so the caches hold the whole turn: the last emitted ones and the end-of-turn
        id; from here on `feed` lists them too."""
        if self.end is not None and (len(self.feed) == len(self.prompt) + len(self.out)):
            self.feed.append(self.end)
        return self.feed[self.cached:]

    def emitted(self) -> List[int]:
        """Generated tokens emitted but not yet in the caches."""
        return self.feed[self.cached:] if self.cached >= len(self.prompt) else []

    @property
    def decoding(self) -> bool:
        """The next row is the token sampled last (a decode row; a prompt's last row is prefill)."""
        return len(self.feed) - self.cached == 1 and bool(self.out)

    @property
    def left(self) -> int:
        """Rows of `feed` not yet computed."""
        return len(self.feed) - self.cached

    def computed(self, n: int):
        """n more rows of `feed` are in the caches."""
        self.cached += n
        self.high = max(self.high, self.cached)

    def accept(self, tok: int, eos, now: float) -> Optional[str]:
        """The token chosen for the end of `feed`: emit it (and the tokens its grammar forces), or say why
        the request is finished ("stop" / "length"); None while it goes on."""
        if not self.out:
            self.stats.ttft_s = self.stats.prefill_s = now - self.submitted
        self.token_times.append(now)
        self.chooser.advance(tok)
        if tok in eos:
            self.end = tok
            return "stop"
        self._append(tok)
        if self._stops.hit or self.chooser.done:
            return "stop"
        if len(self.out) >= self.max_tokens:
            return "length"
        forced = self.chooser.forced(self.max_tokens - len(self.out))
        for t in forced:
            self._append(t)
        self.stats.forced_tokens += len(forced)
        if forced and (self.chooser.done or len(self.out) >= self.max_tokens):
            return "stop" if self.chooser.done else "length"
        return None

    def _append(self, tok: int):
        self.out.append(tok)
        self.feed.append(tok)
        self.stats.generated_tokens = len(self.out)
        self._detok.add_token(tok)
        self._emit(self._stops.feed(self._detok.last_segment), tok)

    def _emit(self, text: str, token: int):
        if text or token >= 0:
            self.text.append(text)
            self.chunks.append(Chunk(text, token))

    def settled(self):
        """Finished, and the caches hold the whole turn: run the caller's on_done; what it raises is kept
        for the caller (raised where it iterates), never into another request's step."""
        if self.on_done is not None:
            try:
                self.on_done(self)
            except Exception as e:  # noqa: BLE001 - reported to this request's caller
                self.failure = e

    def close(self, reason: str, drafter: Optional[str] = None):
        """Finish: flush the text the detokenizer and stop strings held back, fill the closing stats."""
        if reason != "cancelled":
            self._detok.finalize()
            tail = "" if self._stops.hit else self._stops.feed(self._detok.last_segment) + self._stops.flush()
            self._emit(tail, -1)
        self.state, self.finish_reason = DONE, reason
        s = self.stats
        s.finish_reason = reason
        s.stop_sequence = self._stops.hit
        s.turn_s = time.perf_counter() - self.submitted
        if len(self.token_times) > 1:
            s.decode_tok_s = (len(self.token_times) - 1) / (self.token_times[-1] - self.token_times[0])
        s.prefill_tok_s = s.prefilled_tokens / s.prefill_s if s.prefill_s else 0.0
        if drafter is not None:
            s.drafter = drafter
        s.draft_passes, s.drafted_tokens = self.counts["draft_passes"], self.counts["drafted_tokens"]
        s.accepted_tokens = self.counts["accepted_tokens"]
        s.acceptance = s.accepted_tokens / s.drafted_tokens if s.drafted_tokens else 0.0
