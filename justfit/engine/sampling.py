"""The one copy of token choice: sampling settings, logits processors, grammar constraints (with the tokens
they force), the per-position seed and stop strings.

Every path that turns logits into a token (a lone sequence, a batch row, a speculative verify) asks a
`Chooser`; every path that turns tokens into text cuts it with `StopText`. A seeded request draws each
position from its own key, (seed, position), so the same request samples the same tokens alone or beside
others, whatever else shares the step.
"""

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

from ..config import REPETITION_WINDOW
from ..errors import UserError


@dataclass
class Sampling:
    """How to pick tokens. temperature 0 is greedy; top_k 0 / top_p 1 / min_p 0 turn those filters off."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: Optional[float] = None
    repetition_window: int = REPETITION_WINDOW  # the last tokens (prompt included) the three penalties look at
    presence_penalty: Optional[float] = None  # OpenAI's: subtracted once from each token in the window
    frequency_penalty: Optional[float] = None  # OpenAI's: subtracted per occurrence in the window
    logit_bias: Optional[dict] = None
    seed: Optional[int] = None
    stop: Sequence[str] = ()
    logits_processors: Sequence[Callable] = ()
    constraint: object = None  # forced() -> ids, apply(logits) -> logits, advance(id), done

    def __post_init__(self):
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        self.logits_processors = list(self.logits_processors or ())
        _check(self.temperature >= 0, f"temperature must be >= 0, not {self.temperature}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], not {self.top_p}")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be an integer >= 0, not {self.top_k}")
        _check(0 <= self.min_p < 1, f"min_p must be in [0, 1), not {self.min_p}")
        rp = self.repetition_penalty
        _check(rp is None or rp > 0, f"repetition_penalty must be > 0, not {rp}")
        _check(isinstance(self.repetition_window, int) and self.repetition_window >= 1,
               f"repetition_window must be an integer >= 1, not {self.repetition_window}")
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
               f"seed must be an integer >= 0, not {self.seed}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        bias = self.logit_bias or {}
        _check(all(isinstance(k, int) for k in bias), "logit_bias keys must be token ids (integers)")

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing rewriting logits: the only case where drafted tokens can be verified."""
        return self.temperature == 0 and self.constraint is None and not self.processors_needed

    @property
    def processors_needed(self) -> bool:
        return bool(self.logits_processors or self.logit_bias or self.repetition_penalty not in (None, 1.0)
                    or self.presence_penalty or self.frequency_penalty)

    def processors(self) -> List[Callable]:
        from mlx_lm.sample_utils import make_logits_processors

        rp = None if self.repetition_penalty in (None, 1.0) else self.repetition_penalty
        w = self.repetition_window
        return make_logits_processors(self.logit_bias or None, rp, w, self.presence_penalty or None, w,
                                      self.frequency_penalty or None, w) + list(self.logits_processors)

    def sampler(self) -> Callable:
        from mlx_lm.sample_utils import make_sampler

        top_p = self.top_p if self.top_p < 1 else 0.0
        return make_sampler(temp=self.temperature, top_p=top_p, min_p=self.min_p, top_k=self.top_k)


def _check(ok: bool, message: str):
    if not ok:
        raise UserError(message)


class Chooser:
    """Turns one position's logits into a token under one request's Sampling: processors (which see every
    token before the position), the grammar constraint, then greedy or the sampler."""

    def __init__(self, sampling: Sampling):
        self.sampling = sampling
        self.constraint = sampling.constraint
        self.processors = sampling.processors()
        self.sample = sampling.sampler()

    @property
    def rewrites(self) -> bool:
        """Something beyond a plain argmax decides: processors, a constraint or sampling."""
        return bool(self.processors) or self.constraint is not None or self.sampling.temperature > 0

    def logits(self, logits, seen: Sequence[int]):
        """Logits [1, vocab] after the processors (given the tokens `seen` so far) and the constraint."""
        import mlx.core as mx

        if self.processors:
            ctx = mx.array(list(seen))
            for p in self.processors:
                logits = p(ctx, logits)
        if self.constraint is not None:
            logits = self.constraint.apply(logits)
        return logits

    def pick(self, logits, seen: Sequence[int], position: int):
        """The token for `position` (an array of shape [1], not evaluated): `seen` is every token before it."""
        import mlx.core as mx

        logits = self.logits(logits, seen)
        if self.sampling.temperature == 0:
            return mx.argmax(logits, axis=-1)
        if self.sampling.seed is not None:  # one key per position: the same draw alone or in any batch
            mx.random.seed((self.sampling.seed * 1_000_003 + position) % 2**63)
        return self.sample(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    def advance(self, token: int):
        """Move the constraint past `token` (the token chosen for the last position)."""
        if self.constraint is not None:
            self.constraint.advance(token)

    def forced(self, room: int) -> List[int]:
        """The tokens the constraint forces next, at most `room` (it has moved past them already)."""
        if self.constraint is None or self.constraint.done or room <= 0:
            return []
        return list(self.constraint.forced()[:room])

    @property
    def done(self) -> bool:
        """The constraint's grammar is complete: nothing more may follow."""
        return self.constraint is not None and self.constraint.done


class StopText:
    """Cuts streamed text at the first stop string, holding back a tail that may start one."""

    def __init__(self, stops: Sequence[str]):
        self.stops, self.buf = list(stops), ""
        self.hit: Optional[str] = None  # the stop string that ended the text (APIs that report it)

    def feed(self, text: str) -> str:
        """The text that can be emitted now."""
        if not self.stops:
            return text
        self.buf += text
        found = [(i, s) for s in self.stops for i in [self.buf.find(s)] if i >= 0]
        if found:
            cut, self.hit = min(found, key=lambda f: f[0])
            out, self.buf = self.buf[:cut], ""
            return out
        hold = max((k for s in self.stops for k in range(1, len(s)) if self.buf.endswith(s[:k])), default=0)
        out, self.buf = self.buf[:len(self.buf) - hold], self.buf[len(self.buf) - hold:]
        return out

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out
