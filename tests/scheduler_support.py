"""Shared by the scheduler tests: the reference a batched request must match."""

import mlx.core as mx

from justfit.kvexec import make_cache


def greedy_alone(rt, ids, n, kv=None):
    """Greedy tokens of one sequence run by itself through mlx-lm's model call, one token per pass."""
    c = make_cache(rt.model, kv or rt.kv)
    logits = rt.model(mx.array(ids)[None], cache=c)[0, -1]
    out = []
    for _ in range(n):
        out.append(int(mx.argmax(logits)))
        if out[-1] in rt.tokenizer.eos_token_ids:
            return out[:-1]
        logits = rt.model(mx.array([[out[-1]]]), cache=c)[0, -1]
    return out
