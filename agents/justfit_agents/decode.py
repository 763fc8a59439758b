"""Prefill a suffix into a KV cache, then decode one assistant step under an optional grammar."""

import time
from typing import Iterator, List, Optional

PREFILL_CHUNK = 512


def prefill(model, cache: list, tokens: List[int]):
    """Run `tokens` through the model into `cache` in chunks; the last position's logits."""
    import mlx.core as mx

    logits = None
    for i in range(0, len(tokens), PREFILL_CHUNK):
        logits = model(mx.array(tokens[i:i + PREFILL_CHUNK])[None], cache=cache)[:, -1, :]
        mx.eval(logits)  # materialize this chunk's K/V before the next one
    return logits


def decode(model, cache: list, logits, *, max_tokens: int, eos: set, temperature: float = 0.0,
           top_p: float = 1.0, constraint=None, stats: Optional[dict] = None) -> Iterator[int]:
    """Yield tokens until an end-of-turn token, a finished grammar or max_tokens. Tokens the grammar
    forces (JSON keys, tool names) are taken without sampling and fed in one forward pass. The last
    stats["unfed_tokens"] yielded tokens are not in `cache` yet (the next prefill feeds them)."""
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    sampler = make_sampler(temp=temperature, top_p=top_p)
    stats = {} if stats is None else stats
    stats["finish_reason"], stats["forced_tokens"] = "length", 0
    n = 0
    while n < max_tokens:
        new = constraint.forced()[: max_tokens - n] if constraint is not None else []
        stats["forced_tokens"] += len(new)
        if not new:
            if constraint is not None:
                logits = constraint.apply(logits)
            new = [int(sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True)).item())]
            if constraint is not None:
                constraint.advance(new[0])
        if n == 0:
            stats["first_token_at"] = time.perf_counter()
        n += len(new)
        stats["generated_tokens"], stats["unfed_tokens"] = n, len(new)
        yield from new
        if new[-1] in eos:
            stats["finish_reason"] = "stop"
            return
        if constraint is not None and constraint.done:
            stats["finish_reason"] = "grammar"
            return
        if n < max_tokens:
            logits = model(mx.array(new)[None], cache=cache)[:, -1, :]
            stats["unfed_tokens"] = 0
