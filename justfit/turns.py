"""What one turn hands back: streamed chunks, the finished generation and its typed stats.

These are plain records at the bottom of the layers, so the engine, sessions, the CLI, the benches and
the server all report the same fields the same way.
"""

from dataclasses import asdict, dataclass, field
from typing import Iterator, List, Optional


@dataclass
class Chunk:
    """One streamed piece: the new text (may be empty mid-character) and the token id
    (-1 for the final flush of text held back by the detokenizer or a stop string)."""

    text: str
    token: int


@dataclass
class TurnStats:
    """Numbers of one turn. Tokens: prompt = reused (found in the cache) + prefilled (computed now)."""

    prompt_tokens: int = 0
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    forced_tokens: int = 0  # emitted by a grammar without sampling
    ttft_s: float = 0.0  # from the call to the first token
    prefill_s: float = 0.0  # model time of the prefill (first token included)
    prefill_tok_s: float = 0.0  # prefilled_tokens / prefill_s
    decode_tok_s: float = 0.0  # tokens after the first / time after the first
    turn_s: float = 0.0
    peak_memory_bytes: int = 0
    finish_reason: str = "length"  # "stop" (end of turn, stop string, finished grammar) | "length"
    stop_sequence: Optional[str] = None  # the stop string that ended the turn, if one did
    drafter: str = "none"
    draft_passes: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    acceptance: float = 0.0
    reload_s: float = 0.0  # PhaseSwap: time bringing released components back for this turn
    history_tokens: int = 0  # sessions: tokens in the history after the turn
    restore_s: float = 0.0  # sessions: time restoring the session's pages this turn
    checkpoint_s: float = 0.0
    disk_bytes_written: int = 0
    queue_s: float = 0.0  # batching: time waiting for admission
    requested_max_tokens: Optional[int] = None  # regime steering: the caller's budget ...
    reserved_max_tokens: Optional[int] = None  # ... and what was reserved instead
    steer_note: Optional[str] = None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Generation:
    """A finished generation: text, token ids and its TurnStats."""

    text: str
    tokens: List[int]
    stats: TurnStats = field(default_factory=TurnStats)


class Submitted:
    """What a caller holds for a queued generation: iterate it for Chunks (each miss steps its engine),
    `cancel()`, `result()`. Subclasses keep `engine`, `state`, `chunks`, `text`, `out` and `stats`."""

    def __iter__(self):
        return self

    def __next__(self) -> Chunk:
        while True:
            if self.chunks:
                return self.chunks.popleft()
            if self.done:
                self.engine.settle()  # the caller has read every chunk: the turn's last tokens go in now
                failure = getattr(self, "failure", None)
                if failure is not None:  # the caller's own on_done failed (a session could not record the turn)
                    self.failure = None
                    raise failure
                raise StopIteration
            self.engine.step()

    def cancel(self):
        """Stop now: private pages are freed at once; pages shared with the prefix index stay for reuse."""
        self.engine.cancel(self)

    def result(self) -> "Generation":
        """Run to the end and return the Generation (text, tokens, stats)."""
        for _ in self:
            pass
        return Generation("".join(self.text), list(self.out), self.stats)

    @property
    def done(self) -> bool:
        return self.state == "done"


class Turn:
    """A streamed turn: iterate it for Chunks; `stats` is this turn's own TurnStats, filled as it runs, so
    two turns streamed side by side never share or overwrite each other's numbers."""

    def __init__(self, chunks: Iterator[Chunk], stats: TurnStats):
        self.stats = stats
        self._chunks = chunks

    def __iter__(self):
        return self

    def __next__(self) -> Chunk:
        return next(self._chunks)

    def close(self):
        """Stop the turn early (what was generated so far stays in the cache, as after a stop)."""
        self._chunks.close()
