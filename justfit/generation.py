"""THE generation path: every turn of every front (Runtime, sessions, agents, CLI, benches) runs here.

`token_steps` is modelled on mlx-lm's `generate_step`: chunked prefill of the tokens not yet in the
cache (decoder stack only for intermediate chunks), then decode with a sampler, logits processors
(repetition penalty, logit bias, caller's), a grammar constraint with forced tokens, stop token ids
and, for plain greedy decoding, speculative verification of drafted tokens. PhaseSwap phases are
entered through the residency passed in. `stream_turn` turns the ids into text chunks, cuts at stop
strings and fills TurnStats. Nothing else in JustFit calls the model to produce a token.
"""

import time
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence, Set

from .errors import UserError
from .models.vocab import check_token_ids, vocab_size
from .turns import Chunk, TurnStats

PREFILL_STEP = 2048
ONE_PASS = 256  # prompts up to this many new tokens are prefilled with the LM head in a single pass
TIE_EPS = 1e-3


@dataclass
class Sampling:
    """How to pick tokens. temperature 0 is greedy; top_k 0 / top_p 1 / min_p 0 turn those filters off."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: Optional[float] = None
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
        return bool(self.logits_processors or self.logit_bias or self.repetition_penalty not in (None, 1.0))

    def processors(self) -> List[Callable]:
        from mlx_lm.sample_utils import make_logits_processors

        rp = None if self.repetition_penalty in (None, 1.0) else self.repetition_penalty
        return make_logits_processors(self.logit_bias or None, rp) + list(self.logits_processors)

    def sampler(self) -> Callable:
        from mlx_lm.sample_utils import make_sampler

        top_p = self.top_p if self.top_p < 1 else 0.0
        return make_sampler(temp=self.temperature, top_p=top_p, min_p=self.min_p, top_k=self.top_k)


def _check(ok: bool, message: str):
    if not ok:
        raise UserError(message)


def _body(model):
    inner = getattr(model, "model", None)
    return inner if inner is not None and hasattr(inner, "layers") and hasattr(inner, "norm") else None


def _noop_enter(*args, **kwargs) -> float:
    return 0.0


def prefill_workspace(model, n_tokens: int, context: int, head: bool = False) -> int:
    """Rough float32 activation bytes of one prefill chunk (hidden, MLP, bounded attention block, and the
    logits when the LM head runs on every position)."""
    a = getattr(model, "args", None)
    hidden = getattr(a, "hidden_size", 4096)
    inter = getattr(a, "intermediate_size", 4 * hidden)
    heads = getattr(a, "num_attention_heads", 32)
    logits = 4 * n_tokens * getattr(a, "vocab_size", 32000) if head else 0
    return 4 * n_tokens * (4 * hidden + 3 * inter) + 4 * heads * min(n_tokens, 2048) * min(context, 8192) + logits


def prefill(model, cache, ids: List[int], residency=None, progress: Optional[Callable] = None,
            step: int = PREFILL_STEP, after_chunk: Optional[Callable] = None) -> float:
    """Run `ids` through the decoder stack into `cache` in chunks (no LM head), in the prefill phase.
    progress(done, total) after each chunk; after_chunk() lets a session checkpoint. Returns reload seconds."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    if not ids:
        return 0.0
    enter = residency.enter if residency is not None else _noop_enter
    context = (cache[0].offset if cache else 0) + len(ids)
    reload_s = enter("prefill", caches=cache, workspace=prefill_workspace(model, min(step, len(ids)), context))
    body, done = _body(model), 0
    with mx.stream(generation_stream):
        while done < len(ids):
            n = min(step, len(ids) - done)
            (body or model)(mx.array(ids[done:done + n])[None], cache=cache)
            mx.eval([c.state for c in cache])  # this chunk's K/V must exist before the next reads it
            mx.clear_cache()
            done += n
            if progress is not None:
                progress(done, len(ids))
            if after_chunk is not None:
                after_chunk()
    return reload_s


def _computes_while_built(cache) -> bool:
    """A decode step on `cache` runs the CPU kernel, which evaluates as the step is built (kvexec.kernel_serves):
    building the next step before reading the pending token would only read it a step late."""
    from .kvexec import PagedKVCache, kernel_serves

    first = next((c for c in cache if isinstance(c, PagedKVCache) and c.window is None), None)
    return first is not None and kernel_serves([first])


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


def token_steps(model, prompt: List[int], cache, sampling: Sampling, max_tokens: int = 256,
                stop: Set[int] = frozenset(), history: Sequence[int] = (), residency=None, drafter=None,
                gate=None, counts: Optional[dict] = None, progress: Optional[Callable] = None) -> Iterator[int]:
    """Prefill `prompt` (the tokens not in `cache`; `history` is what the cache already holds) then yield
    up to max_tokens ids. Each yielded id is in the cache (fed) by the time the next one is yielded, the
    last one (end-of-turn id included) when the generator finishes or is closed."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    enter = residency.enter if residency is not None else _noop_enter
    counts = counts if counts is not None else {}
    for key in ("reload_s", "draft_passes", "drafted_tokens", "accepted_tokens", "forced_tokens"):
        counts.setdefault(key, 0)
    sample, processors, constraint = sampling.sampler(), sampling.processors(), sampling.constraint
    seen = list(history) + list(prompt)  # what logits processors see (prompt + generated)

    def choose(logits):
        if processors:
            ctx = mx.array(seen)
            for p in processors:
                logits = p(ctx, logits)
        if constraint is not None:
            logits = constraint.apply(logits)
        return sample(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    def forward(ids):
        return model(mx.array(ids)[None], cache=cache)[:, -1, :]

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
                logits = model(y[None], cache=cache)[:, -1, :]  # feeds the pending token, still unread
                nxt = None if last else choose(logits)
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
            if constraint is not None:
                constraint.advance(tok)
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
            if constraint is not None and not finished:
                forced = constraint.forced()[: max_tokens - n - 1]
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


class StopText:
    """Cuts streamed text at the first stop string, holding back a tail that may start one."""

    def __init__(self, stops: Sequence[str]):
        self.stops, self.buf, self.hit = list(stops), "", False

    def feed(self, text: str) -> str:
        """The text that can be emitted now."""
        if not self.stops:
            return text
        self.buf += text
        cut = min((i for i in (self.buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.buf, self.hit = self.buf[:cut], "", True
            return out
        hold = max((k for s in self.stops for k in range(1, len(s)) if self.buf.endswith(s[:k])), default=0)
        out, self.buf = self.buf[:len(self.buf) - hold], self.buf[len(self.buf) - hold:]
        return out

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


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
    if sampling.seed is not None:
        mx.random.seed(sampling.seed)
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
