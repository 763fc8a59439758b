"""Speculative decoding of one greedy sequence: a drafter proposes tokens after the pending one and a
single pass over the sequence's own pages verifies them; rejected drafts are trimmed, nothing moves.

Only plain greedy decoding drafts (Sampling.plain_greedy), so output is unchanged. A position whose two
best log-probabilities are closer than TIE_EPS is left to a plain step, so batched-GEMM rounding can never
flip a greedy choice. Both the lone-sequence loop (solo.py) and the core's lone request use `speculate`.
"""

import time
from typing import List

TIE_EPS = 1e-3


def _noop_enter(*args, **kwargs) -> float:
    return 0.0


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


def speculate(model, cache, tok: int, drafter, gate, room: int, stop, counts: dict, enter=_noop_enter):
    """One draft+verify pass after `tok` (the pending token, not yet in `cache`) for plain greedy decoding,
    if the gate is open and the drafter proposes: (tokens now in the cache, `tok` first; the next pending
    token, None after a stop id; whether the next step must be plain) or None when no pass ran. `room`
    bounds the drafts; drafter.hist must end with tok. The single-sequence loop and the batching engine's
    lone-request mode both call this."""
    if gate is not None and not gate.open():
        return None
    room = min(gate.k if gate else 4, room)
    k = min(room, _max_draft(cache, room))
    drafts = drafter.propose(k) if k >= 1 else []
    if not drafts:
        return None
    return _verify(model, cache, tok, drafts, stop, gate, counts, enter, drafter)


def _verify(model, cache, tok: int, drafts: List[int], stop, gate, counts, enter, drafter):
    """One pass over [tok, d1..dk]: keep tok and the accepted drafts in the cache, trim the rest. Returns
    (kept tokens, next pending token or None after a stop token, next step plain?). A position whose
    top-2 log-probabilities are closer than TIE_EPS is recomputed by a plain step, so batched-GEMM
    rounding can never flip a greedy choice (then the pending token is already in drafter.hist)."""
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
            tie = True
            break
        if j == k or choice[j] != drafts[j]:
            pending = choice[j]
            break
        accepted += 1
        stopped = drafts[j] in stop
    out = [tok] + drafts[:accepted]
    drafter.extend(drafts[:accepted])
    counts["draft_passes"] = counts.get("draft_passes", 0) + 1
    counts["drafted_tokens"] = counts.get("drafted_tokens", 0) + k
    if tie and accepted == 0:  # nothing new decided: rewind the whole pass, redo tok plainly
        for c in cache:
            c.trim(k + 1)
        return [], tok, True
    if tie:
        pending, out = out[-1], out[:-1]  # the last accepted draft becomes pending (unfed)
    for c in cache:
        c.trim(k + 1 - len(out))
    counts["accepted_tokens"] = counts.get("accepted_tokens", 0) + len(out) - 1
    if gate is not None:
        gate.spec(time.perf_counter() - t0, k, len(out) - 1)
    return out, (None if stopped else pending), tie
