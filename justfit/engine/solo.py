"""The lone-sequence token loop: a turn on caches the caller owns (rt.stream, sessions, chat, agents).

`token_steps` is modelled on mlx-lm's `generate_step`: chunked prefill of the tokens not yet in the
cache (decoder stack only for intermediate chunks), then decode with overlapped steps, choosing each
token through the request's Chooser (sampling.py: processors, grammar and forced tokens, seeds) and, for
plain greedy decoding, verifying drafted tokens (runner.py). PhaseSwap phases are entered through
the residency passed in. `stream_turn` turns the ids into text chunks, cuts at stop strings and fills
the TurnStats the caller owns. The core (core.py) serves submitted requests with the same choice,
speculation and single-sequence KV modes; this loop is the part not yet folded into it.
"""

import time
from typing import Callable, Iterator, List, Optional, Sequence, Set

from ..errors import UserError
from ..models.vocab import check_token_ids, vocab_size
from ..turns import Chunk, TurnStats
from .sampling import Chooser, Sampling, StopText
from .runner import no_phase, last_logits, prefill, prefill_workspace, speculate

ONE_PASS = 256  # prompts up to this many new tokens are prefilled with the LM head in a single pass


def _computes_while_built(cache) -> bool:
    """A decode step on `cache` runs the CPU kernel, which evaluates as the step is built (kvexec.kernel_serves):
    building the next step before reading the pending token would only read it a step late."""
    from ..kvexec import PagedKVCache, kernel_serves

    first = next((c for c in cache if isinstance(c, PagedKVCache) and c.window is None), None)
    return first is not None and kernel_serves([first])


def token_steps(model, prompt: List[int], cache, sampling: Sampling, max_tokens: int = 256,
                stop: Set[int] = frozenset(), history: Sequence[int] = (), residency=None, drafter=None,
                gate=None, counts: Optional[dict] = None, progress: Optional[Callable] = None) -> Iterator[int]:
    """Prefill `prompt` (the tokens not in `cache`; `history` is what the cache already holds) then yield
    up to max_tokens ids. Each yielded id is in the cache (fed) by the time the next one is yielded, the
    last one (end-of-turn id included) when the generator finishes or is closed."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    enter = residency.enter if residency is not None else no_phase
    counts = counts if counts is not None else {}
    for key in ("reload_s", "draft_passes", "drafted_tokens", "accepted_tokens", "forced_tokens"):
        counts.setdefault(key, 0)
    chooser = Chooser(sampling)
    processors, constraint = chooser.processors, chooser.constraint
    seen = list(history) + list(prompt)  # every token before the one being chosen (prompt + generated)

    def choose(logits, ahead: int = 0):
        """The token after `seen` (and `ahead` tokens fed but not yet read into it)."""
        return chooser.pick(logits, seen, len(seen) + ahead)

    def forward(ids):
        return last_logits(model, cache, ids)

    with mx.stream(generation_stream):
        # A short prompt (a chat turn on a cached history) goes through the full model in one pass: the
        # LM head over <= ONE_PASS positions costs less than a second pass through every layer.
        tail = len(prompt) if len(prompt) <= ONE_PASS else 1
        counts["reload_s"] += prefill(model, cache, list(prompt[:-tail]), residency, progress)
        context = (cache[0].offset if cache else 0) + tail
        counts["reload_s"] += enter("prefill-last", caches=cache, workspace=prefill_workspace(model, tail, context, head=True))
        y = choose(forward(prompt[-tail:]))
        mx.eval(y)
        counts["reload_s"] += enter("decode", caches=cache)
        spec = sampling.plain_greedy and drafter is not None
        if spec:
            drafter.reset(list(seen))
        # Steps overlap as in mlx-lm: the next one is built on the pending token before it is read, so graph
        # building runs while the previous step computes. A step waits for its token only where something
        # must see it first: logits processors, a constraint, a drafter whose proposals cost a pass, or a
        # token after which the (cheap) drafter could propose. Where the CPU kernel serves decode, a step
        # computes while it is built: no overlap to win, so the token is read, yielded, then fed.
        overlap = not processors and constraint is None and (not spec or getattr(drafter, "cheap", False))
        n, force_plain, known, wait = 0, False, False, True  # known: the pending token is already in drafter.hist
        t_tok = None
        while n < max_tokens:
            built = _computes_while_built(cache)
            if overlap and not wait and not built:
                last = n + 1 >= max_tokens
                logits = last_logits(model, cache, y)  # feeds the pending token, still unread
                nxt = None if last else choose(logits, ahead=1)
                mx.async_eval(logits if last else nxt)
                tok = int(y.item())
                seen.append(tok)
                if spec:
                    drafter.extend([tok])
                    now = time.perf_counter()
                    if t_tok is not None and gate is not None:
                        gate.plain(now - t_tok)  # overlapped steps: seconds between tokens
                    t_tok = now
                    wait = (gate is None or gate.open()) and bool(drafter.propose(1))
                yield tok
                n += 1
                if last or tok in stop:
                    return
                y = nxt
                if n % 256 == 0:
                    mx.clear_cache()
                continue
            t_tok = None
            tok = int(y.item())
            chooser.advance(tok)
            if spec:
                if not known:
                    drafter.extend([tok])
                known = False
                res = None if force_plain else speculate(model, cache, tok, drafter, gate, max_tokens - n - 1,
                                                         stop, counts, enter)
                if res is not None:
                    out, pending, force_plain = res
                    known = force_plain
                    for t in out:
                        yield t
                    n += len(out)
                    if pending is None:
                        return
                    y = mx.array(pending)
                    continue
                force_plain = False
            finished = tok in stop or (constraint is not None and constraint.done) or n + 1 >= max_tokens
            feed = [tok]
            if not finished:
                forced = chooser.forced(max_tokens - n - 1)
                counts["forced_tokens"] += len(forced)
                feed += forced
            ahead = built and len(feed) == 1  # the step computes as it is built: show tok first, then feed it
            if ahead:
                try:
                    yield tok
                except GeneratorExit:  # the caller stops at this token: it is fed all the same, as on every path
                    mx.eval(forward(feed))
                    raise
                n += 1
            t0 = time.perf_counter()
            seen.extend(feed)
            logits = forward(feed)  # the last id is fed too: the next turn reuses its K/V
            if finished:
                mx.async_eval(logits)
                if not ahead:
                    yield tok
                return
            y = choose(logits)
            mx.async_eval(y)
            for t in () if ahead else feed:
                yield t
                n += 1
                if t in stop:
                    return
            if constraint is not None and constraint.done and len(feed) > 1:
                return
            if gate is not None and spec:
                mx.eval(y)
                gate.plain(time.perf_counter() - t0)
            wait = False
            if n % 256 == 0:
                mx.clear_cache()


def stream_turn(model, tokenizer, tokens: List[int], cache, reused: int, max_tokens: int, sampling: Sampling,
                stats: TurnStats, residency=None, drafter=None, gate=None, steer=None,
                progress: Optional[Callable] = None, fed: Optional[List[int]] = None) -> Iterator[Chunk]:
    """One turn: prefill tokens[reused:], decode, detokenize, stop at end-of-turn ids or stop strings.
    `steer(context, max_tokens) -> (reserved, note)` is an optional decode-budget policy; stats are filled
    in place as the turn goes; `fed` receives every generated id the cache now holds (end-of-turn too)."""
    import mlx.core as mx

    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise UserError(f"max_tokens must be an integer >= 1, not {max_tokens!r}")
    if not tokens:
        raise UserError("the prompt renders to no tokens")
    if not 0 <= reused < len(tokens):
        raise ValueError("reused tokens must leave at least one token to prefill")
    check_token_ids(tokens, vocab_size(model))
    detok = tokenizer.detokenizer
    detok.reset()
    eos = set(tokenizer.eos_token_ids)
    stats.prompt_tokens, stats.reused_tokens, stats.prefilled_tokens = len(tokens), reused, len(tokens) - reused
    stats.finish_reason = "length"
    budget = max_tokens
    if steer is not None:
        reserved, note = steer(len(tokens), max_tokens)
        stats.requested_max_tokens, stats.reserved_max_tokens, stats.steer_note = max_tokens, reserved, note
        budget = max(reserved, max_tokens)
    spec = sampling.plain_greedy and drafter is not None
    counts: dict = {}
    mx.reset_peak_memory()
    start = time.perf_counter()
    stops = StopText(sampling.stop)
    steps = token_steps(model, tokens[reused:], cache, sampling, budget, eos, tokens[:reused], residency,
                        drafter if spec else None, gate, counts, progress)
    first = None
    try:
        for n, token in enumerate(steps):
            if n >= max_tokens:  # a steered budget reserves more; the caller's limit still stops us
                break
            if fed is not None:
                fed.append(token)
            if first is None:
                first = time.perf_counter()
                stats.ttft_s = stats.prefill_s = first - start
                stats.prefill_tok_s = stats.prefilled_tokens / stats.prefill_s if stats.prefill_s else 0.0
            if token in eos:
                stats.finish_reason = "stop"
                break
            stats.generated_tokens = n + 1
            detok.add_token(token)
            text = stops.feed(detok.last_segment)
            stats.decode_tok_s = n / (time.perf_counter() - first) if n else 0.0
            if stops.hit:
                stats.finish_reason = "stop"
                if text:
                    yield Chunk(text, -1)
                break
            yield Chunk(text, token)
        else:
            if sampling.constraint is not None and sampling.constraint.done:
                stats.finish_reason = "stop"
    finally:
        steps.close()
        if residency is not None:
            residency.enter("idle")
        stats.drafter = drafter.name if spec else "none"
        stats.reload_s = counts.get("reload_s", 0.0)
        stats.forced_tokens = counts.get("forced_tokens", 0)
        for key in ("draft_passes", "drafted_tokens", "accepted_tokens"):
            setattr(stats, key, counts.get(key, 0))
        stats.acceptance = stats.accepted_tokens / stats.drafted_tokens if stats.drafted_tokens else 0.0
        stats.peak_memory_bytes = mx.get_peak_memory()
        stats.turn_s = time.perf_counter() - start
    if not stops.hit:
        detok.finalize()
        tail = stops.feed(detok.last_segment) + stops.flush()
        if tail:
            yield Chunk(tail, -1)
