"""Drafters for speculative greedy decoding, and the gate that switches drafting off when it does not pay.

- `PromptLookup` (weight-free, on by default): finds the longest recent n-gram match of the history's
  tail earlier in the history (agents repeat file contents and tool output) and proposes what
  followed it.
- `DraftModel`: a small model with the same tokenizer proposes tokens greedily from its own cache,
  trimmed back to the accepted history after each verification.
- `Gate`: measures seconds per token of plain steps and of draft+verify passes; drafting runs only
  while it is faster (and it re-probes after a cool-down that doubles each time it loses).
Verification itself lives in decode.py: one forward pass scores 2-8 draft tokens, rejected ones are
rewound with `cache.trim`, so greedy output equals non-speculative greedy output.
"""

from typing import Dict, List, Optional, Tuple

MIN_DRAFT, MAX_DRAFT = 2, 8


class PromptLookup:
    """n-gram lookup in the token history (longest n first, most recent occurrence)."""

    name = "prompt-lookup"
    component = None
    cheap = True  # a proposal costs no model pass: the decode loop may ask after every token

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.reset([])

    def reset(self, history: List[int]):
        self.hist: List[int] = list(history)
        self.index: Dict[Tuple[int, ...], int] = {}  # n-gram -> position of its last token
        self.indexed = 0  # n-grams ending before this position are in the index

    def extend(self, tokens: List[int]):
        self.hist.extend(tokens)

    def trim_history(self, n: int):
        """Forget the last n tokens (the cache was rewound)."""
        if n:
            del self.hist[-n:]
            self.index = {k: e for k, e in self.index.items() if e < len(self.hist) - 1}
            self.indexed = min(self.indexed, max(0, len(self.hist) - 1))

    def propose(self, k: int) -> List[int]:
        """Up to k tokens that followed the latest earlier occurrence of the history's tail."""
        h = self.hist
        for end in range(self.indexed, len(h) - 1):  # never index the tail itself
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end - n + 1 >= 0:
                    self.index[tuple(h[end - n + 1 : end + 1])] = end
        self.indexed = max(self.indexed, len(h) - 1)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(h) < n:
                continue
            end = self.index.get(tuple(h[-n:]))
            if end is not None:
                return h[end + 1 : end + 1 + k]
        return []


class DraftModel:
    """Greedy proposals from a small model sharing the target's tokenizer, with its own trimmable cache."""

    name = "draft-model"

    def __init__(self, model, component: Optional[str] = None):
        self.model, self.component = model, component
        self.cache = None
        self.reset([])

    def reset(self, history: List[int]):
        from mlx_lm.models.cache import make_prompt_cache

        self.hist: List[int] = list(history)
        if self.cache is None or any(c.offset for c in self.cache):
            self.cache = make_prompt_cache(self.model)
        self.seen: List[int] = []  # tokens whose KV is in self.cache

    def extend(self, tokens: List[int]):
        self.hist.extend(tokens)

    def trim_history(self, n: int):
        if n:
            del self.hist[-n:]

    def propose(self, k: int) -> List[int]:
        import mlx.core as mx

        common = 0
        for a, b in zip(self.seen, self.hist):
            if a != b:
                break
            common += 1
        common = min(common, len(self.hist) - 1)  # refeed at least the last token
        for c in self.cache:
            c.trim(c.offset - common)
        feed = self.hist[common:]
        out = []
        for _ in range(k):
            logits = self.model(mx.array(feed)[None], cache=self.cache)[0, -1]
            tok = int(mx.argmax(logits).item())
            out.append(tok)
            feed = [tok]
        self.seen = self.hist + out[:-1]
        return out


class Gate:
    """Turns drafting off when draft+verify emits tokens slower than plain steps; re-probes later."""

    def __init__(self, margin: float = 1.0, alpha: float = 0.3, min_passes: int = 1):
        self.margin, self.alpha, self.min_passes = margin, alpha, min_passes
        self.plain_s: Optional[float] = None  # seconds per token, plain decode (EMA)
        self.spec_s: Optional[float] = None  # seconds per emitted token, draft+verify (EMA)
        self.passes = self.drafted = self.accepted = 0
        self.cooldown = self.off_for = 0
        self.k = 4  # current draft length

    def _ema(self, old, new):
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def open(self) -> bool:
        """Whether the next step may draft."""
        if self.off_for > 0:
            self.off_for -= 1
            return False
        return True

    def plain(self, seconds: float):
        self.plain_s = self._ema(self.plain_s, seconds)

    def spec(self, seconds: float, drafted: int, accepted: int):
        """Record a pass that emitted accepted+1 tokens; adapt k; close the gate when it loses."""
        self.passes += 1
        self.drafted += drafted
        self.accepted += accepted
        self.spec_s = self._ema(self.spec_s, seconds / (accepted + 1))
        self.k = min(MAX_DRAFT, self.k + 2) if accepted == drafted else max(MIN_DRAFT, accepted + 1)
        if self.plain_s is not None and self.passes >= self.min_passes and self.spec_s * self.margin > self.plain_s:
            self.cooldown = min(256, max(16, self.cooldown * 2))
            self.off_for = self.cooldown
            self.spec_s = None  # re-measure from scratch after the cool-down

    def miss(self):
        """No proposal this step (no n-gram match): costs nothing, the plain step runs."""

    def stats(self) -> dict:
        rate = self.accepted / self.drafted if self.drafted else 0.0
        return {"draft_passes": self.passes, "drafted_tokens": self.drafted, "accepted_tokens": self.accepted,
                "acceptance": rate}


def load_draft_model(spec: str, target_tokenizer, home=None):
    """Load a draft model by any spec justfit.load accepts; its tokenizer must match the target's."""
    from ..errors import UserError
    from ..models import load

    model, tok = load(spec, home=home)
    if tok.vocab_size != target_tokenizer.vocab_size or tok.get_vocab() != target_tokenizer.get_vocab():
        raise UserError(f"draft model {spec!r} has a different tokenizer from the target model")
    return model
