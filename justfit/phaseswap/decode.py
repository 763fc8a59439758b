"""Phased generation: chunked prefill without the LM head, then decode, speculative when a drafter helps.

`phased_steps` is a drop-in for mlx-lm's `generate_step` (yields `(token, None)`; the cache holds the
prompt and every yielded token at each yield) that switches the residency phase as it goes:
`prefill` for all but the last prompt token (decoder stack only, in chunks), `prefill-last` for the
last token, `decode` after. With temperature 0 and a drafter whose gate is open, a step proposes
2-8 tokens, scores `[pending, d1..dk]` in one forward pass (`verify` phase), accepts the longest
prefix the target model itself would have chosen, and trims the rest from the cache.
Exactness guards: a draft never crosses a quantizing page boundary (a KVExec page reopened by a trim
would come back dequantized), and a position whose top-2 log-probabilities are closer than TIE_EPS is
recomputed by a plain one-token step, so batched-GEMM rounding can never flip a greedy choice.
"""

import time
from typing import Iterator, List, Optional, Set, Tuple

PREFILL_STEP = 2048
TIE_EPS = 1e-3


def _body(model):
    inner = getattr(model, "model", None)
    return inner if inner is not None and hasattr(inner, "layers") and hasattr(inner, "norm") else None


def _max_draft(cache, room: int) -> int:
    """Longest draft that keeps every trim exact: stop before a page that would seal quantized."""
    k = room
    for c in cache:
        if not c.is_trimmable():
            return 0
        seq, kv = getattr(c, "seq", None), getattr(c, "kv", None)
        if seq is not None and kv is not None and kv.bits != 16:
            P = seq.page_size
            k = min(k, P - (c.offset % P) - 2)
    return k


def prefill_workspace(model, n_tokens: int, context: int) -> int:
    """Rough float32 activation bytes of one prefill chunk (hidden, MLP, bounded attention block)."""
    a = getattr(model, "args", None)
    hidden = getattr(a, "hidden_size", 4096)
    inter = getattr(a, "intermediate_size", 4 * hidden)
    heads = getattr(a, "num_attention_heads", 32)
    return 4 * n_tokens * (4 * hidden + 3 * inter) + 4 * heads * min(n_tokens, 2048) * min(context, 8192)


def phased_steps(model, prompt: List[int], cache, residency=None, max_tokens: int = 256, sampler=None,
                 drafter=None, gate=None, history: Optional[List[int]] = None,
                 stop: Set[int] = frozenset(), counts: Optional[dict] = None) -> Iterator[Tuple[int, None]]:
    """Prefill `prompt` (the tokens not yet in `cache`) then generate up to max_tokens tokens.
    `history` is every token before the prompt (for prompt lookup); `counts` receives draft stats."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    enter = residency.enter if residency is not None else (lambda *a, **k: 0.0)
    counts = counts if counts is not None else {}
    counts.update(reload_s=0.0, draft_passes=0, drafted_tokens=0, accepted_tokens=0)
    greedy = sampler is None
    sample = sampler or (lambda lp: mx.argmax(lp, axis=-1))

    def step(tokens):
        logits = model(mx.array(tokens)[None], cache=cache)[:, -1, :]
        return sample(logits - mx.logsumexp(logits, keepdims=True))

    with mx.stream(generation_stream):
        body, ids = _body(model), list(prompt)
        head = 1 if len(ids) else 0
        context = (cache[0].offset if cache else 0) + len(ids)
        if len(ids) > 1:
            counts["reload_s"] += enter("prefill", caches=cache,
                                        workspace=prefill_workspace(model, min(PREFILL_STEP, len(ids)), context))
        while len(ids) > head:
            n = min(PREFILL_STEP, len(ids) - head)
            (body or model)(mx.array(ids[:n])[None], cache=cache)  # no LM head on intermediate chunks
            mx.eval([c.state for c in cache])
            ids = ids[n:]
            mx.clear_cache()
        counts["reload_s"] += enter("prefill-last", caches=cache, workspace=prefill_workspace(model, 1, context))
        y = step(ids)
        mx.eval(y)
        counts["reload_s"] += enter("decode", caches=cache)
        spec_ok = greedy and drafter is not None
        if spec_ok:
            drafter.reset(list(history or []) + list(prompt))
        n, force_plain, known = 0, False, False  # known: the pending token is already in drafter.hist
        while n < max_tokens:
            tok = int(y.item())
            if spec_ok and not known:
                drafter.extend([tok])
            known, k = False, 0
            if spec_ok and not force_plain and (gate is None or gate.open()):
                room = min(gate.k if gate else 4, max_tokens - n - 1)
                k = min(room, _max_draft(cache, room))
            drafts = drafter.propose(k) if k >= 1 else []
            if drafts:
                out, pending, force_plain, known = yield from _verify(model, cache, tok, drafts, stop, gate, counts,
                                                                      enter, drafter)
                n += len(out)
                if pending is None:
                    return
                y = mx.array(pending)
                continue
            force_plain = False
            t0 = time.perf_counter()
            nxt = step([tok])  # feed the pending token before yielding it (cache = prompt + yielded)
            mx.async_eval(nxt)
            yield tok, None
            n += 1
            if tok in stop:
                return
            if gate is not None:
                mx.eval(nxt)
                gate.plain(time.perf_counter() - t0)
            if n % 256 == 0:
                mx.clear_cache()
            y = nxt


def _verify(model, cache, tok: int, drafts: List[int], stop, gate, counts, enter, drafter):
    """One pass over [tok, d1..dk]: yield tok and the accepted drafts, trim the rest. Returns (yielded
    tokens, next pending token or None after a stop token, next step plain?, pending already in history?)."""
    import mlx.core as mx

    t0 = time.perf_counter()
    enter("verify", caches=cache)
    k = len(drafts)
    logits = model(mx.array([tok] + drafts)[None], cache=cache)[0]
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    top2 = mx.topk(lp, 2, axis=-1)
    choice = mx.argmax(lp, axis=-1)
    mx.eval(choice, top2)
    choice, top2 = choice.tolist(), top2.tolist()
    accepted, pending, tie, stopped = 0, None, False, tok in stop
    for j in range(k + 1):  # position j decides the token after input j
        if stopped:
            break
        if abs(top2[j][1] - top2[j][0]) < TIE_EPS:
            tie = True  # recompute this position with a plain one-token step
            break
        if j == k or choice[j] != drafts[j]:
            pending = choice[j]
            break
        accepted += 1
        stopped = drafts[j] in stop
    out = [tok] + drafts[:accepted]
    drafter.extend(drafts[:accepted])
    counts["draft_passes"] += 1
    counts["drafted_tokens"] += k
    if tie and accepted == 0:  # nothing new decided: rewind the whole pass, redo tok plainly
        for c in cache:
            c.trim(k + 1)
        return [], tok, True, True
    if tie:
        pending, out = out[-1], out[:-1]  # the last accepted draft becomes pending (unfed)
    for c in cache:
        c.trim(k + 1 - len(out))
    counts["accepted_tokens"] += len(out) - 1
    if gate is not None:
        gate.spec(time.perf_counter() - t0, k, len(out) - 1)
    for t in out:
        yield t, None
    return out, (None if stopped else pending), tie, tie
