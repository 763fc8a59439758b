"""Every call of the model that produces tokens: prefill chunks, a lone sequence's step, the batched pass
over a plan, and the speculative verify. Nothing else in JustFit runs the model to serve a token (the
probe and the benches time the model and mlx-lm directly; a drafter's own small model only proposes).

The Runner executes a plan, [(request, rows)], and decides nothing: the scheduler chose the rows, the core
takes the tokens. A lone decode row runs mlx-lm's single-sequence call on its own caches (cheaper than the
batched pass, whose decode attention stacks a padded page run every step); anything else runs the batched
pass of kvexec/batch.py over the shared page pool.

Speculative decoding of one greedy sequence: a drafter proposes tokens after the pending one and a single
pass over the sequence's own pages verifies them; rejected drafts are trimmed, nothing moves. Only plain
greedy decoding drafts, so output is unchanged; a position whose two best log-probabilities are closer than
TIE_EPS is left to a plain step, so batched-GEMM rounding can never flip a greedy choice.
"""

import time
from typing import Callable, List, Optional

PREFILL_STEP = 2048
TIE_EPS = 1e-3


def no_phase(*args, **kwargs) -> float:
    return 0.0


def last_logits(model, cache, ids):
    """Logits [1, vocab] after feeding `ids` (a list, or an array of pending tokens) to one sequence. Only
    the last row reaches the LM head where the model allows (a prompt's last chunk would otherwise pay the
    head, the largest weight, for every row of the chunk)."""
    import mlx.core as mx

    x = ids if isinstance(ids, mx.array) else mx.array(ids)
    inner = _plain_body(model)
    if inner is not None and x.size > 1:
        return head(model, inner(x[None], cache=cache)[:, -1:, :])[:, -1, :]
    return model(x[None], cache=cache)[:, -1, :]


def _plain_body(model):
    """model.model for the models whose output is head(model.model(x)) and nothing else, else None."""
    inner = getattr(model, "model", None)
    return inner if inner is not None and type(model).__module__.rsplit(".", 1)[-1] in _HEAD_MODELS else None


def head(model, h):
    """The LM head over hidden states h (the tied embedding's as_linear, or lm_head)."""
    if getattr(getattr(model, "args", None), "tie_word_embeddings", False):
        return model.model.embed_tokens.as_linear(h)
    return model.lm_head(h)


def body_of(model):
    """The decoder stack without the LM head (mlx-lm models keep it as model.model), or None."""
    inner = getattr(model, "model", None)
    return inner if inner is not None and hasattr(inner, "layers") and hasattr(inner, "norm") else None


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
    enter = residency.enter if residency is not None else no_phase
    context = (cache[0].offset if cache else 0) + len(ids)
    reload_s = enter("prefill", caches=cache, workspace=prefill_workspace(model, min(step, len(ids)), context))
    body, done = body_of(model), 0
    with mx.stream(generation_stream):
        while done < len(ids):
            n = min(step, len(ids) - done)
            prefill_chunk(model, cache, ids[done:done + n], body)
            done += n
            if progress is not None:
                progress(done, len(ids))
            if after_chunk is not None:
                after_chunk()
    return reload_s


def prefill_chunk(model, cache, ids: List[int], body=None):
    """Write one chunk's K/V through the decoder stack (no LM head) and evaluate it: the next chunk reads it."""
    import mlx.core as mx

    (body or model)(mx.array(ids)[None], cache=cache)
    mx.eval([c.state for c in cache])
    mx.clear_cache()


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


def speculate(model, cache, tok: int, drafter, gate, room: int, stop, counts: dict, enter=no_phase):
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
    logits = model(mx.array([tok] + drafts)[None], cache=cache)[0]  # every drafted position's logits
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


def batched_logits(model, plan, tokens):
    """Logits [segments, vocab] at each segment's last row after one forward pass over the plan's rows;
    tokens: ids, or an array of them (not yet computed, when the caller queues a step ahead). The plan is
    kvexec/batch.py's BatchPlan: every sequence's caches and rows, read and written in place."""
    import mlx.core as mx

    inputs = (tokens if isinstance(tokens, mx.array) else mx.array(list(tokens)))[:, None]
    rows = mx.array(plan.last_rows())
    inner = _plain_body(model)
    if inner is not None:
        return head(model, _sampled_hidden(inner, plan, inputs, rows))[:, -1]  # only sampled rows reach the head
    return model(inputs, cache=plan.layers)[rows, -1]


_HEAD_MODELS = ("llama", "mistral", "qwen2", "qwen3")  # model(x) == head(model.model(x)), nothing else
# and model.model(x) == norm(layers(embed_tokens(x))) with no mask (BatchLayer.make_mask) when unpipelined


def _sampled_hidden(inner, plan, inputs, rows):
    """inner(inputs)[rows]. When the step has prompt rows, the last layer runs twice: over every row, only
    writing K/V, then attention and MLP over the sampled rows alone; a prompt row's last-layer output is
    never used (mlx-lm's prefill skips it by evaluating caches only), ~44% of a 2-layer wide model's FLOPs."""
    from ..kvexec.batch import BatchLayer

    layers = list(inner.layers)
    if plan.rows == len(plan.segments) or getattr(inner, "pipeline_size", 1) != 1 or len(layers) != len(plan.layers):
        return inner(inputs, cache=plan.layers)[rows]
    h = inner.embed_tokens(inputs)
    for layer, cache in zip(layers[:-1], plan.layers):
        h = layer(h, None, cache)
    layers[-1](h, None, BatchLayer(plan, len(layers) - 1, attend=False))  # every row's K/V into its pages
    return inner.norm(layers[-1](h[rows], None, plan.sampled().layers[-1]))


def follow(drafter, feed: List[int]):
    """Bring the drafter's history up to `feed`: extend it when it is a prefix of feed, else start anew
    (another request drafted last)."""
    h = drafter.hist
    if h and len(h) <= len(feed) and feed[:len(h)] == h:
        drafter.extend(feed[len(h):])
    else:
        drafter.reset(list(feed))


class Runner:
    """The model and how to run it over requests' caches."""

    def __init__(self, model, kv, residency=None, consensus=None):
        self.model, self.kv, self.residency = model, kv, residency  # kv: the KV manager
        self.consensus = consensus  # the engine's Consensus: under mlx.launch rank 0's tokens stand

    @staticmethod
    def reset_peak():
        """Start counting peak memory anew (a turn on an idle engine reports its own peak)."""
        import mlx.core as mx

        mx.reset_peak_memory()

    @staticmethod
    def peak() -> int:
        import mlx.core as mx

        return mx.get_peak_memory()

    def enter(self, phase: str, **kwargs) -> float:
        """Enter a PhaseSwap phase (weights back just in time); seconds spent reloading."""
        return self.residency.enter(phase, **kwargs) if self.residency is not None else 0.0

    def start(self, plan: List[tuple]) -> tuple:
        """Build and start one forward pass over `plan`: (plan, logits, argmax), evaluating asynchronously;
        (plan, None, None) for a lone request's prefill chunk that samples nothing. Rows count as computed
        from here on; prompt and recomputed rows count as prefilled."""
        import mlx.core as mx

        if len(plan) == 1 and plan[0][1] > 1:
            return self._lone_prefill(*plan[0])
        reload_s = self.enter("decode")
        if len(plan) == 1:
            plan[0][0].stats.reload_s += reload_s
        ids = [t for r, n in plan for t in r.feed[r.cached:r.cached + n]]
        logits = self.forward(plan, ids)
        for r, n in plan:
            _computed(r, n)
        greedy = self._agreed(mx.argmax(logits, axis=-1))  # every plain greedy row's token, in the same evaluation
        mx.async_eval(logits, greedy, *[c.state for r, _ in plan if r.left for c in r.caches])
        return plan, logits, greedy

    def _lone_prefill(self, r, n: int) -> tuple:
        """A chunk of a request running alone, through mlx-lm's own single-sequence call on its caches (its
        single-sequence KV modes stay): the decoder stack only, unless the chunk ends the prompt (then the
        LM head too), in the phase PhaseSwap needs for it, with the chunk's workspace."""
        import mlx.core as mx

        ids = r.feed[r.cached:r.cached + n]
        context = r.cached + n
        if r.cached + n < len(r.feed):
            workspace = prefill_workspace(self.model, n, context)
            r.stats.reload_s += self.enter("prefill", caches=r.caches, workspace=workspace)
            prefill_chunk(self.model, r.caches, ids, body_of(self.model))
            _computed(r, n)
            if r.progress is not None:
                start = r.stats.reused_tokens
                r.progress(r.cached - start, len(r.prompt) - start)
            return [(r, n)], None, None
        workspace = prefill_workspace(self.model, n, context, head=True)
        r.stats.reload_s += self.enter("prefill-last", caches=r.caches, workspace=workspace)
        logits = last_logits(self.model, r.caches, ids)
        _computed(r, n)
        greedy = mx.argmax(logits, axis=-1)
        mx.eval(logits, greedy)  # the first token exists before the phase changes under it
        r.stats.reload_s += self.enter("decode", caches=r.caches)
        return [(r, n)], logits, greedy

    def feed(self, caches: list, ids: List[int]):
        """Write ids after what caches hold (the end of a turn on caller-owned caches: the next turn reuses
        their K/V); nothing is sampled."""
        import mlx.core as mx

        if ids:
            mx.async_eval(last_logits(self.model, caches, ids))

    def queue(self, nxt: List[tuple], greedy) -> tuple:
        """Build the next decode-only pass on this pass's argmax before it is read (as mlx-lm's generate loop
        does): building the graph overlaps the computation. Rows are counted when the pass is taken."""
        import mlx.core as mx

        self.kv.reserve([(r, 1) for r, _ in nxt])
        logits = self.forward(nxt, greedy)
        greedy = self._agreed(mx.argmax(logits, axis=-1))
        mx.async_eval(logits, greedy)
        return nxt, logits, greedy

    def _agreed(self, greedy):
        return self.consensus.agree_tokens(greedy) if self.consensus is not None else greedy

    @staticmethod
    def computes_while_built(plan: List[tuple]) -> bool:
        """The CPU kernel serves this pass: it evaluates as the pass is built, so queueing the next one
        early would only publish this step's tokens a step late."""
        from ..kvexec import PagedKVCache, kernel_serves

        firsts = [r.caches[0] for r, _ in plan]
        return all(isinstance(c, PagedKVCache) for c in firsts) and kernel_serves(firsts)

    def forward(self, plan: List[tuple], ids):
        """Logits [len(plan), vocab] at each request's last row; ids: a list, or the last step's argmax array."""
        import mlx.core as mx

        from ..kvexec.batch import BatchPlan

        if len(plan) == 1 and plan[0][1] == 1:
            logits = last_logits(self.model, plan[0][0].caches, ids.reshape(1) if isinstance(ids, mx.array) else ids)
            if self.kv.over_budget():
                self.kv.drop_copies()  # its decode memo does not fit beside the pages: workspace of this step only
            return logits
        return batched_logits(self.model, BatchPlan([(r.caches, n) for r, n in plan], *self.kv.memo(plan)), ids)

    def pick(self, r, logits, greedy: int) -> int:
        """r's next token from its row's logits; `greedy` (the row's argmax) is used as is when nothing
        rewrites the logits."""
        if not r.chooser.rewrites:
            return greedy
        tok = int(r.chooser.pick(logits[None], r.feed, len(r.feed))[0])
        return self.consensus.agree(tok) if self.consensus is not None else tok

    def speculate(self, r, drafter, gate, eos) -> Optional[tuple]:
        """Draft after r's pending token and verify the drafts in one pass over r's own pages (rejected drafts
        are trimmed from those pages, nothing moves): (tokens now in the cache, next pending token or None)
        or None when no pass ran."""
        room = r.max_tokens - len(r.out)
        if room < 1 or not self.kv.fits(self.kv.grow_bytes(r.cached, min(room, 8) + 1)):
            return None
        follow(drafter, r.feed)
        res = speculate(self.model, r.caches, r.feed[-1], drafter, gate, room, eos, r.counts, self.enter)
        if res is None:
            return None
        out, pending, r.force_plain = res
        start = r.cached
        r.computed(len(out))
        self.kv.publish_sealed(r, start)
        return out, pending


def _computed(r, n: int):
    """n rows of r computed by a pass: prompt rows and recomputed ones count as prefilled (a generated id is
    fed once, as a decode row)."""
    first_time = max(0, r.cached + n - max(len(r.prompt), r.high, r.cached))
    r.stats.prefilled_tokens += n - first_time
    r.computed(n)
