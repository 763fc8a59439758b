"""The batching scheduler on the real default model: joins and leaves, chunked prefill next to decodes,
cancellation, bad requests, prefix sharing, preemption under a tiny KV budget, Runtime.submit/generate_batch."""

import uuid

import pytest

import justfit
from justfit.config import KVConfig
from justfit.errors import UserError
from justfit.engine import Engine

from tests.scheduler_support import greedy_alone


@pytest.fixture(scope="module")
def rt(shallow_model_dir, tmp_path_factory):
    """The default model cut to 10 layers (conftest.shallow_model_dir: scheduling works per step and per
    request alike at any depth) with small fp16 pages (several sealed pages per request) and its own store."""
    return justfit.Runtime(model=str(shallow_model_dir), kv=KVConfig(bits=16, page_size=32),
                           home=tmp_path_factory.mktemp("sched-home"))


def _engine(rt, **kw):
    return Engine(rt.model, rt.tokenizer, rt.make_cache, index=rt.index, kv=rt.kv, **kw)


def _unique(text):
    return f"[{uuid.uuid4().hex}] {text}"  # nothing cached from another test or run


def test_join_leave_and_chunked_prefill_next_to_decode(rt):
    eng = _engine(rt, step_tokens=24)
    a_ids = rt.encode(_unique("Name three colors."))
    b_ids = rt.encode(_unique("Write a long answer: why is the sky blue, and why are sunsets red? " * 2))
    a = eng.submit(a_ids, max_tokens=10)
    while len(a.out) < 3:
        eng.step()
    b = eng.submit(b_ids, max_tokens=6)  # joins mid-batch; its prefill is chunked (> 24 tokens)
    c = eng.submit(rt.encode(_unique("Hi")), max_tokens=2)  # leaves early
    steps_with_b_prefilling = 0
    while not (a.done and b.done and c.done):
        before = len(a.out)
        eng.step()
        if not b.out and b.cached and not a.done:
            steps_with_b_prefilling += 1
            assert len(a.out) == before + 1 or a.done  # the decoder never stalls behind B's prefill
    assert steps_with_b_prefilling >= 2
    assert a.out == greedy_alone(rt, a_ids, 10)
    assert b.out == greedy_alone(rt, b_ids, 6)
    assert c.done and len(c.out) <= 2
    assert b.stats.prefilled_tokens == len(b_ids) - b.stats.reused_tokens and b.stats.generated_tokens == len(b.out)


def test_cancel_frees_private_pages_at_once(rt):
    pool, index = rt.index.pool, rt.index
    assert index.sequence_refs() == 0
    eng = _engine(rt)
    keep = eng.submit(rt.encode(_unique("Count to ten.")), max_tokens=8)
    drop = eng.submit(rt.encode(_unique("Tell me about the moon. " * 6)), max_tokens=50)
    for _ in range(3):
        eng.step()
    drop_pages = set(drop.caches[0].seq.table)
    held = index.sequence_refs()
    drop.cancel()
    assert index.sequence_refs() == held - len(drop_pages)  # its references are gone now, not at the end
    private = {p for p in drop_pages if p not in set(index.mem.values())}
    assert private and not private & set(pool.refs)  # and its private pages are free
    assert drop.done and drop.finish_reason == "cancelled"
    assert len(list(drop)) <= 3  # what was produced before the cancel, then the iteration ends
    keep.result()
    assert index.sequence_refs() == 0  # back to baseline: only the prefix index holds pages


def test_bad_requests_refused_without_disturbing_the_batch(rt):
    ids = rt.encode(_unique("What is the capital of France?"))
    eng = _engine(rt)
    r = eng.submit(ids, max_tokens=8)
    eng.step()
    for bad, kw, words in (([], {}, "empty"), (ids, {"max_tokens": 0}, "max_tokens"),
                           ([1] * 9000, {}, "context"), (ids, {"temperature": -1}, "temperature"),
                           ([10**7], {}, "vocabulary")):
        with pytest.raises(UserError, match=words):
            eng.submit(bad, **kw)
    with pytest.raises(UserError, match="context"):  # a session's own caches: its history counts the same
        eng.submit([1] * 8100, max_tokens=100, caches=rt.make_cache(), reused=0)
    assert r.result().tokens == greedy_alone(rt, ids, 8)


def test_shared_prefix_is_prefilled_once_even_in_the_same_step(rt):
    system = _unique("You are a careful assistant. " * 12)  # > 2 pages of 32 tokens
    prompts = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
               for q in ("Name a fruit.", "Name a planet.", "Name a river.")]
    eng = _engine(rt)
    reqs = [eng.submit(rt.encode(p), max_tokens=4) for p in prompts]
    gens = eng.run(reqs)
    first, rest = gens[0].stats, [g.stats for g in gens[1:]]
    shared = min(s.reused_tokens for s in rest)
    assert first.reused_tokens < 32 and first.prefilled_tokens == first.prompt_tokens - first.reused_tokens
    assert shared >= 64  # the followers attached the leader's prefix pages instead of prefilling them
    assert sum(s.prefilled_tokens for s in rest) == sum(s.prompt_tokens - s.reused_tokens for s in rest)
    for p, g in zip(prompts, gens):
        assert g.tokens == greedy_alone(rt, rt.encode(p), 4)


def test_preemption_under_a_tiny_budget_gives_the_same_tokens(rt):
    prompts = [rt.encode(_unique(f"Story number {i}: a fox, a crow and a piece of cheese.")) for i in range(3)]
    free = _engine(rt)
    ref = free.run([free.submit(p, max_tokens=32) for p in prompts])
    # room for two prompts plus one page: both grow by a page or more while decoding, so one is preempted
    budget = 2 * free.kv.kv_bytes.seq(max(map(len, prompts))) + free.kv.kv_bytes.open
    eng = _engine(rt, budget_bytes=budget)
    reqs = [eng.submit(p, max_tokens=32) for p in prompts]
    gens = eng.run(reqs)
    assert eng.scheduler.preempted >= 1  # memory really ran out mid-decode
    assert sum(r.restored_tokens for r in reqs) >= 32  # checkpointed pages came back, not recomputed
    assert [g.tokens for g in gens] == [g.tokens for g in ref]
    assert max(g.stats.queue_s for g in gens) > 0


def test_runtime_submit_generate_batch_and_async(rt):
    import asyncio

    # a fixed tag, not _unique: the uuid would change the greedy answer from run to run; this test's own
    # tag keeps its prompts apart from other tests' in the shared store
    qs = ["[submit-batch-async] What is the capital of France?", "[submit-batch-async] Name three colors."]
    gens = rt.generate_batch(qs, max_tokens=8)
    assert [g.tokens for g in gens] == [greedy_alone(rt, rt.encode(q), 8) for q in qs]
    stop = gens[0].text.split()[-1]  # a word the greedy reply reaches within its 8 tokens
    req = rt.submit(qs[0], max_tokens=12, stop=[stop])
    text = "".join(c.text for c in req)
    assert stop not in text and req.stats.finish_reason == "stop", (stop, text)

    async def main():
        a = rt.submit_async(qs[1], max_tokens=5)
        got = [c.text async for c in a]
        return "".join(got), await a.result()

    text, g = asyncio.run(main())
    assert text == g.text and g.tokens == gens[1].tokens[:5]


def test_prefill_next_to_decoders_is_capped_and_a_lone_prompt_is_not(rt):
    prompts = [rt.encode(_unique(f"Prompt {i}: list the planets of the solar system, with one fact each.")) for i in range(4)]
    lone = _engine(rt, step_tokens=128, prefill_with_decode=8)
    first = lone.submit(prompts[0], max_tokens=1)
    rows = lone.step()
    assert first.done and rows == len(prompts[0]) - first.stats.reused_tokens > 8  # nobody decodes: one step
    eng = _engine(rt, step_tokens=128, prefill_with_decode=8)
    reqs, capped = [], 0
    while len(reqs) < len(prompts) or not all(r.done for r in reqs):
        if len(reqs) < len(prompts) and eng.steps % 3 == 0:
            reqs.append(eng.submit(prompts[len(reqs)], max_tokens=12))  # joins while others decode
        decoding = any(len(r.feed) - r.cached == 1 and r.out for r in eng.scheduler.running)
        before = sum(r.stats.prefilled_tokens for r in reqs)
        eng.step()
        rows = sum(r.stats.prefilled_tokens for r in reqs) - before
        if decoding:
            assert rows <= 8, f"step {eng.steps}: {rows} prefill rows next to decoders"
            capped += rows == 8
    assert capped >= 3  # prompts really were prefilled in capped chunks next to decoders
    for p, r in zip(prompts, reqs):
        assert r.out == greedy_alone(rt, p, 12)


def test_common_prefix_counts_at_most_limit_items():
    from justfit.statetrans.index import common_prefix

    assert common_prefix([1, 2, 3, 4], [1, 2, 3, 5]) == 3
    assert common_prefix([1, 2, 3, 4], [1, 2, 3, 4], limit=2) == 2  # a follower's last token is never shared
    assert common_prefix([1, 2], [1, 2, 3], limit=5) == 2 and common_prefix([1], [1], limit=0) == 0


def test_a_lone_request_runs_the_single_sequence_call(rt, monkeypatch):
    """Alone, a request keeps the single-sequence path: its prefill chunks and decode steps run mlx-lm's own
    call on its caches, never the batched pass (and give the tokens of a run by itself)."""
    import justfit.engine.runner as runner

    batched, rows = runner.batched_logits, []
    monkeypatch.setattr(runner, "batched_logits", lambda model, plan, ids: rows.append(plan.rows) or batched(model, plan, ids))
    ids = rt.encode(_unique("Name three colors."))
    r = _engine(rt).submit(ids, max_tokens=6)
    assert r.result().tokens == greedy_alone(rt, ids, 6)
    assert rows == []


def test_a_lone_request_keeps_single_sequence_mode_until_another_joins(rt, monkeypatch):
    """Admitted alone, a request keeps its float window and float32 open page (the single-sequence path, as
    fast as chat's); once a second request runs beside it, both run batched (no window, 16-bit open pages:
    what the capacity arithmetic counts), and each gives the tokens it gives alone with its caches switched at
    the same token. (Against a run that never switched, ~1 uuid prompt in 13 differs at a near-tie: top-2
    logits within 0.07, which the 4-bit reads of the window's pages may flip.)"""
    import mlx.core as mx

    from justfit.kvexec import PagedKVCache, make_cache

    switched, for_batch = {}, PagedKVCache.for_batch

    def recording(cache):
        switched.setdefault(id(cache), cache.offset)
        for_batch(cache)

    monkeypatch.setattr(PagedKVCache, "for_batch", recording)
    kv = KVConfig(page_size=32, quantized_kv_start=32)  # 4-bit pages from the second page on
    eng = Engine(rt.model, rt.tokenizer, lambda: make_cache(rt.model, kv), kv=kv)
    ids = [rt.encode(_unique(f"Lighthouse keeper's note {i}: the lamp was trimmed, the fog came in. " * 2))
           for i in range(2)]
    a = eng.submit(ids[0], max_tokens=12)
    while len(a.out) < 4:
        eng.step()
    assert not any(c.batched for c in a.caches) and any(c.recent for c in a.caches)
    assert a.caches[0].open_dtype == mx.float32
    b = eng.submit(ids[1], max_tokens=6)
    while b.caches is None:  # (a pass queued ahead runs first)
        eng.step()
    both = a.caches + b.caches
    assert all(c.batched and not c.recent for c in both) and {c.open_dtype.size for c in both} == {2}
    at = [switched[id(r.caches[0])] for r in (a, b)]
    assert at[0] >= len(ids[0]) + 4 and at[1] == 0  # a switched mid-decode, b before its prefill
    assert [r.result().tokens for r in (a, b)] == [greedy_alone(rt, ids[0], 12, kv, batched_from=at[0]),
                                                   greedy_alone(rt, ids[1], 6, kv, batched_from=at[1])]


def test_stacked_pages_count_in_the_budget(rt):
    """Batched decode keeps stacked copies of sealed pages between steps; they count in used_bytes, and
    under a budget that holds the pages but not the copies none are kept, with the same tokens."""
    from justfit.kvexec.batch import memo_nbytes

    text = "Tide gauge log, entry {}. The pier reading rose and fell with the wind all night. "
    prompts = [rt.encode(_unique(text.format(i) * 4)) for i in range(3)]

    def run(eng):
        reqs = [eng.submit(p, max_tokens=6) for p in prompts]
        kept = 0
        while not all(r.done for r in reqs):
            eng.step()
            kept = max(kept, memo_nbytes(eng.kv.stacks))
            assert eng.used_bytes() == eng.kv.pool.nbytes + memo_nbytes(eng.kv.stacks) + _lone_memo_bytes(reqs)
            if eng.budget_bytes is not None:
                assert eng.used_bytes() <= eng.budget_bytes
        return [r.result().tokens for r in reqs], kept

    free = _engine(rt)
    pages = sum(free.kv.kv_bytes.worst(len(p) + 6) for p in prompts) + len(prompts) * free.kv.kv_bytes.open
    tight = _engine(rt, budget_bytes=rt.index.pool.nbytes + pages)  # the pages fit, their stacks do not
    got, kept = run(tight)
    assert kept == 0 and tight.scheduler.preempted == 0
    ref, kept = run(free)  # (attaches the pages the tight run cached: same tokens either way)
    assert kept > 0 and got == ref  # three decoders with sealed pages: without a budget stacks are kept


def test_batched_decode_keeps_float_copies_of_4bit_pages_only_where_the_budget_holds_them(runtime16):
    """Batched decode's memo keeps sealed 4-bit pages dequantized to float32 (BLAS reads them ~5x faster than
    MLX's CPU quantized_matmul) when the budget holds those copies, else in their stored format: the budget
    is never passed and the tokens are the same. On the whole default model: the cut one's replies are
    near-ties that the two formats' rounding flips."""
    from justfit.kvexec import make_cache
    from justfit.kvexec.batch import memo_nbytes

    rt = runtime16

    kv = KVConfig(page_size=32, quantized_kv_start=32)  # 4-bit pages from the second page on
    text = "Survey notebook {}: the river bend moved two metres east after the spring flood, again. "
    prompts = [rt.encode(_unique(text.format(i) * 14)) for i in range(3)]  # ~9 sealed pages each

    def run(budget):
        eng = Engine(rt.model, rt.tokenizer, lambda: make_cache(rt.model, kv), kv=kv, budget_bytes=budget)
        reqs = [eng.submit(p, max_tokens=6) for p in prompts]
        kept = 0
        while not all(r.done for r in reqs):
            eng.step()
            kept = max(kept, memo_nbytes(eng.kv.stacks))
            assert budget is None or eng.used_bytes() <= budget
        return [r.result().tokens for r in reqs], kept, eng

    ref, floats, eng = run(None)
    longest = max(len(p) + 6 for p in prompts) // kv.page_size * kv.page_size
    pages = sum(eng.kv.kv_bytes.worst(len(p) + 6) for p in prompts) + len(prompts) * eng.kv.kv_bytes.open
    stored = 2 * len(prompts) * eng.kv.kv_bytes.seq(longest)  # the scheduler's bound on stored-format copies
    assert stored < floats  # float copies of these pages do not fit beside the stored ones' bound
    got, kept, _ = run(pages + stored)
    assert 0 < kept < floats and got == ref


def _lone_memo_bytes(reqs):
    """Bytes of the decode memos (kvexec/decode.py) the requests' caches hold: filled while one decodes alone."""
    return sum(c.memo.nbytes for r in reqs if r.caches for c in r.caches)


def _window_bytes(reqs):
    """Bytes of the float-window copies the requests' caches hold (a request admitted alone keeps them)."""
    return sum(c.window_nbytes for r in reqs if r.caches for c in r.caches)


def test_a_lone_decoders_memo_counts_in_the_budget_and_goes_first(rt):
    """A request decoding alone reads its sealed 4-bit pages through its caches' decode memo and its float
    window: the copies count in used_bytes, and under a budget that holds the pages but not the copies they
    are dropped (never kept over the budget), with the same tokens."""
    from justfit.kvexec import make_cache

    kv = KVConfig(page_size=32, quantized_kv_start=32)  # 4-bit pages from the second page on
    ids = rt.encode(_unique("Harbour ledger: the ferry left at dawn and came back at noon with salt. " * 3))

    def run(budget):
        eng = Engine(rt.model, rt.tokenizer, lambda: make_cache(rt.model, kv), kv=kv, budget_bytes=budget)
        r = eng.submit(ids, max_tokens=8)
        held, pool, kept = 0, 0, 0
        while not r.done:
            eng.step()
            memo, window = _lone_memo_bytes([r]), _window_bytes([r])
            held, pool, kept = max(held, memo), max(pool, eng.kv.pool.nbytes if r.caches else 0), max(kept, window)
            if r.caches:
                assert eng.used_bytes() == eng.kv.pool.nbytes + memo + window
            if budget is not None:
                assert eng.used_bytes() <= budget
        return r.result().tokens, held, pool, kept

    ref, held, pool, window = run(None)
    assert held > 0 and window > 0  # the mechanism ran: sealed 4-bit pages stacked for decode, float copies kept
    got, kept, _, still = run(pool + window + held // 2)  # the pages and the window fit, the memo does not
    assert got == ref and kept < held and still == window
    got, _, _, still = run(pool + window // 2)  # not even the window: the lone request runs batched
    assert len(got) == 8 and still < window


def test_decode_steps_are_queued_ahead_and_a_cancel_in_between_is_exact(rt):
    """While every running request decodes greedily, each step queues the next pass on its argmax before
    reading it (mlx-lm's overlap); tokens equal each request run alone, a request cancelled while a pass
    is queued leaves the others exact, and every reference goes back to the index."""
    index = rt.index
    eng = _engine(rt)
    prompts = [rt.encode(_unique(t)) for t in ("Name three rivers.", "Describe rain. " * 5, "Count to five.")]
    reqs = [eng.submit(p, max_tokens=12) for p in prompts]
    queued = 0
    while not all(r.done for r in reqs):
        eng.step()
        queued += eng._ahead is not None
        if eng._ahead is not None and len(reqs[1].out) == 4 and not reqs[1].done:
            reqs[1].cancel()  # its row of the queued pass is dropped
    assert queued > 10  # the mechanism ran on most steps
    assert reqs[1].finish_reason == "cancelled" and len(reqs[1].out) == 4
    for i in (0, 2):
        assert reqs[i].result().tokens == greedy_alone(rt, prompts[i], 12)
    assert index.sequence_refs() == 0


def test_prefill_next_to_decoders_grows_only_from_measured_steps(rt):
    fixed = _engine(rt, step_tokens=128, prefill_with_decode=8)
    assert fixed.scheduler.chunks.rows() == 8 and not fixed.scheduler.chunks.adaptive  # a cap given is a cap kept
    eng = _engine(rt, step_tokens=128)
    assert eng.scheduler.chunks.adaptive and eng.scheduler.chunks.rows() == eng.scheduler.chunks.floor  # nothing measured yet
    reqs = [eng.submit(rt.encode(_unique(f"Prompt {i}: name a planet.")), max_tokens=4) for i in range(3)]
    eng.run(reqs)
    assert eng.scheduler.chunks.samples  # the steps it waited for were measured
    assert all(0 < rows <= 128 and seconds > 0 for rows, seconds in eng.scheduler.chunks.samples)
    assert eng.scheduler.chunks.floor <= eng.scheduler.chunks.rows() <= 128
