"""Shared by the scheduler tests: the reference a batched request must match."""

import mlx.core as mx

from justfit.kvexec import make_cache


def greedy_alone(rt, ids, n, kv=None, batched_from=None):
    """Greedy tokens of one sequence run by itself through mlx-lm's model call, one token per pass.
    batched_from: the token count at which its caches switch to batched mode (`for_batch`: no float window,
    16-bit open page), as the scheduler switches a request's caches when another joins; with 4-bit pages
    that changes what attention reads, so a batched request matches this run, not one that never switched."""
    c = make_cache(rt.model, kv or rt.kv)
    at = len(ids) + n if batched_from is None else batched_from

    def feed(tokens):
        k = at - c[0].offset  # tokens to feed before the switch
        if 0 < k < len(tokens):
            mx.eval(rt.model(mx.array(tokens[:k])[None], cache=c))
            tokens = tokens[k:]
        if c[0].offset == at:  # switch where the scheduler switched
            for layer in c:
                layer.for_batch()
        return rt.model(mx.array(tokens)[None], cache=c)[0, -1]

    logits = feed(list(ids))
    out = []
    for _ in range(n):
        out.append(int(mx.argmax(logits)))
        if out[-1] in rt.tokenizer.eos_token_ids:
            return out[:-1]
        logits = feed([out[-1]])
    return out
