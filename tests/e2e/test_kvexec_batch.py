"""Batched paged attention (kvexec/batch.py): a batch of sequences with different lengths gives each
sequence what it gets alone, and no row ever reads another sequence's pages."""

import mlx.core as mx
import pytest

from justfit.config import KVConfig
from justfit.kvexec import attention, make_cache, streams
from justfit.kvexec.attention import paged_attention
from justfit.engine.runner import batched_logits as forward
from justfit.kvexec.batch import BatchPlan, _decode_batch
from justfit.kvexec.pages import Page, PagePool

PROMPTS = ["Explain why the sky is blue in two sentences.",
           "Write a haiku about the sea and the moon, with some detail about the waves at night.",
           "Hi"]
CONFIGS = [KVConfig(bits=16, page_size=32), KVConfig(bits=4, page_size=32, quantized_kv_start=32),
           KVConfig(bits=4, format="rotated", page_size=32, quantized_kv_start=0),
           KVConfig(bits=8, page_size=32, quantized_kv_start=0),
           KVConfig(bits=4, key_format="affine", page_size=32, quantized_kv_start=0)]  # [1] is the default: channel keys


@pytest.fixture
def rt(shallow):
    """The default model cut to 6 layers (conftest.shallow): batching works per layer alike at any depth."""
    shallow.phaseswap.enter("decode")  # weights resident even if an earlier test ran a tool phase
    return shallow


def _alone(model, kv, ids, n):
    c = make_cache(model, kv)
    logits = model(mx.array(ids)[None], cache=c)[0, -1]
    out, steps = [], []
    for _ in range(n):
        steps.append(logits)
        out.append(int(mx.argmax(logits)))
        logits = model(mx.array([[out[-1]]]), cache=c)[0, -1]
    return out, mx.stack(steps)


def _batched(model, kv, prompts, n, join_at=2):
    """The first two prompts prefill together; the third joins (prefill chunk next to decodes) at step join_at."""
    caches = [make_cache(model, kv) for _ in prompts]
    outs, steps = [[] for _ in prompts], [[] for _ in prompts]
    fed = [0, 0, 0]
    for step in range(n + join_at):
        segs, ids, who = [], [], []
        for i, p in enumerate(prompts):
            if i == 2 and step < join_at or len(outs[i]) >= n:
                continue
            piece = p if not outs[i] else [outs[i][-1]]
            segs.append((caches[i], len(piece)))
            ids += piece
            who.append(i)
        if not who:
            break
        logits = forward(model, BatchPlan(segs), ids)
        for j, i in enumerate(who):
            steps[i].append(logits[j])
            outs[i].append(int(mx.argmax(logits[j])))
            fed[i] += 1
    return outs, [mx.stack(s) for s in steps]


SLOW = pytest.mark.slow  # the same check in two more formats (each ~40 forward passes of the model)


@pytest.mark.parametrize("kv", CONFIGS[:2] + [pytest.param(k, marks=SLOW) for k in CONFIGS[2:]], ids=lambda k: k.name)
def test_batch_equals_each_sequence_alone(rt, kv):
    prompts = [rt.encode(p) for p in PROMPTS]
    got, logits = _batched(rt.model, kv, prompts, 8)
    for p, g, lg in zip(prompts, got, logits):
        ref, ref_logits = _alone(rt.model, kv, p, 8)
        assert g == ref  # several sealed (quantized) pages, the open one, a join mid-batch
        if kv.bits == 16:
            assert mx.allclose(lg, ref_logits, atol=1e-3)


def _poison(caches):
    """Replace every page of a sequence by NaN arrays of the same shapes and dtypes."""
    seq = caches[0].seq
    for layer in range(seq.pool.n_layers):
        for pid in seq.table:
            page = seq.pool.get(layer, pid)
            k, v = page.parts()
            nan = lambda a: mx.full(a.shape, float("nan")).astype(a.dtype) if mx.issubdtype(a.dtype, mx.floating) else mx.full(a.shape, 0xFFFFFFFF, dtype=a.dtype)  # noqa: E731
            seq.pool.put(layer, pid, Page(page.kind, tuple(nan(a) for a in k), tuple(nan(a) for a in v)))


@pytest.mark.parametrize("kv", CONFIGS[:3], ids=lambda k: k.name)
def test_rows_never_read_other_sequences_pages(rt, kv):
    model = rt.model
    prompts = [rt.encode(p) for p in PROMPTS]
    clean, dirty = ([make_cache(model, kv) for _ in prompts] for _ in range(2))
    for caches in (clean, dirty):
        forward(model, BatchPlan([(c, len(p)) for c, p in zip(caches, prompts)]), [t for p in prompts for t in p])
        mx.eval([c.state for cs in caches for c in cs])
    _poison(dirty[1])
    for step in range(3):  # decode batch, then decode + a prefill chunk in one pass
        extra = rt.encode("Tell me more.") if step == 2 else [7]
        a, b = (forward(model, BatchPlan([(cs[0], 1), (cs[1], 1), (cs[2], len(extra))]), [11, 12] + extra)
                for cs in (clean, dirty))
        assert bool(mx.isnan(b[1]).any())  # the poison is really read by its own row
        assert mx.array_equal(a[0], b[0]) and mx.array_equal(a[2], b[2])


@pytest.mark.parametrize("kv", CONFIGS[:2], ids=lambda k: k.name)
def test_prompt_rows_skip_the_last_layer_and_match_a_full_pass(rt, kv):
    """With prompt chunks in the step, forward runs the last layer's attention and MLP for the sampled rows
    only (_sampled_hidden): the logits, and the pages it writes, are those of one plain pass over every row."""
    model = rt.model
    prompts = [rt.encode(p) for p in PROMPTS[:2]] + [rt.encode("Tell me more about the waves, please.")]
    fast, full = ([make_cache(model, kv) for _ in prompts] for _ in range(2))
    steps = [([0, 1], [prompts[0], prompts[1]]), ([0, 1, 2], [[11], [12], prompts[2]]), ([0, 1, 2], [[5], [6], [7]])]
    for who, pieces in steps:  # two prompts; two decoders beside a prompt; decode only (reads what was written)
        ids = [t for p in pieces for t in p]
        plan = BatchPlan([(fast[i], len(p)) for i, p in zip(who, pieces)])
        ref_plan = BatchPlan([(full[i], len(p)) for i, p in zip(who, pieces)])
        got = forward(model, plan, ids)
        ref = model(mx.array(ids)[:, None], cache=ref_plan.layers)[mx.array(ref_plan.last_rows()), -1]
        assert got.shape == ref.shape
        assert mx.allclose(got, ref, atol=1e-4, rtol=1e-4), float(mx.abs(got - ref).max())
    assert [c.offset for c in fast[2]] == [c.offset for c in full[2]]


def _filled_cache(kv, n_tokens, H=3, D=64, seed=0, pool=None, batched=False):
    """A one-layer paged cache holding n_tokens random keys/values written in uneven pieces."""
    from justfit.kvexec.cache import PagedKVCache
    from justfit.kvexec.pages import Sequence

    mx.random.seed(seed)
    pool = pool or PagePool(1, kv.page_size)
    c = PagedKVCache(Sequence(pool), 0, kv)
    if batched:
        c.for_batch()
    done = 0
    for piece in (5, 40, 1, 100, 7, 300):
        n = min(piece, n_tokens - done)
        if n <= 0:
            break
        c.update_and_fetch(mx.random.normal((1, H, n, D)), mx.random.normal((1, H, n, D)))
        done += n
    c.settle_window()  # as attention leaves it after each chunk (these pieces had none)
    return c


@pytest.mark.parametrize("merge", ["whole", "online", "streams"])
@pytest.mark.parametrize("kv", CONFIGS, ids=lambda k: k.name)
def test_decode_batch_matches_single_sequence_attention(kv, merge, monkeypatch):
    """Every merge of batched decode: one softmax over all runs, run by run (big batches, long contexts), and
    runs split across parallel CPU streams (streams.py) with their softmax states merged."""
    pool = PagePool(1, kv.page_size)
    lengths = [1, 31, 32, 33, 150, 453]
    caches = [_filled_cache(kv, n, seed=i, pool=pool) for i, n in enumerate(lengths)]
    caches[4].trim(3)  # a sealed page cut by a trim: partial and still quantized until the next write
    q = mx.random.normal((len(lengths), 9, 64))
    refs = [paged_attention(q[i][None, :, None], c, 0.125)[0, :, 0] for i, c in enumerate(caches)]
    used = []
    if merge == "online":
        monkeypatch.setattr(attention, "CHAIN_ELEMENTS", 0)  # every block too big: run by run
    if merge == "streams":
        if mx.default_device() != mx.cpu:
            pytest.skip("runs are split across streams on the CPU backend only")
        monkeypatch.setattr(streams, "SPLIT_ELEMENTS", 1)
        monkeypatch.setattr(streams, "MAX_PARTS", 3)
        real = streams.on
        monkeypatch.setattr(streams, "on", lambda i: used.append(i) or real(i))
    got = _decode_batch(q, caches, 0.125)
    assert sorted(set(used)) == ([0, 1, 2] if merge == "streams" else [])
    for i, ref in enumerate(refs):
        assert mx.allclose(got[i], ref, atol=2e-5, rtol=1e-4), (kv.name, lengths[i])


@pytest.mark.parametrize("kv", CONFIGS, ids=lambda k: k.name)
def test_batched_open_pages_are_read_whole_and_masked(kv, monkeypatch):
    """Batched sequences (for_batch: no float window) read their open pages stacked, cut at the longest count
    rounded up to whole OPEN_STEP slots, the slots past each page's count masked; poisoned slots there never
    reach the output."""
    from justfit.kvexec import batch

    pool = PagePool(1, kv.page_size)
    lengths = [1, 33, 150, 453]  # every one ends inside an open page
    caches = [_filled_cache(kv, n, seed=i, pool=pool, batched=True) for i, n in enumerate(lengths)]
    for c in caches:  # undefined slots past the count: NaN
        pid = c.seq.table[-1]
        page = pool.get(0, pid)
        n = c.offset - (len(c.seq.table) - 1) * kv.page_size
        k, v = (x[0] for x in page.parts())
        hole = (mx.arange(k.shape[1]) >= n)[None, :, None]
        pool.put(0, pid, Page(page.kind, (mx.where(hole, float("nan"), k).astype(k.dtype),),
                              (mx.where(hole, float("nan"), v).astype(v.dtype),)))
    q = mx.random.normal((len(lengths), 9, 64))
    refs = [paged_attention(q[i][None, :, None], c, 0.125)[0, :, 0] for i, c in enumerate(caches)]
    calls = []
    real = batch._open_run
    monkeypatch.setattr(batch, "_open_run", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(batch, "OPEN_STEP", 8)  # pages of 32 here: the cut takes 24 slots for a longest count of 22
    got = _decode_batch(q, caches, 0.125)
    assert calls  # the whole-page path ran
    longest = max(c.offset - (len(c.seq.table) - 1) * kv.page_size for c in caches)
    assert longest <= kv.page_size - batch.OPEN_STEP  # the cut read fewer slots than a page (and masks the rest)
    for i, ref in enumerate(refs):
        assert not bool(mx.isnan(got[i]).any()) and mx.allclose(got[i], ref, atol=2e-5, rtol=1e-4), (kv.name, lengths[i])


@pytest.mark.parametrize("kv", CONFIGS[:2], ids=lambda k: k.name)
def test_memo_of_sealed_stacks_follows_the_batch(kv):
    """Stacks reused across steps give what fresh stacks give: after appends, after a page seals, and
    after a sequence is swapped for another holding as many pages (poisoned: a stale stack would not read it)."""
    pool = PagePool(1, kv.page_size)
    caches = [_filled_cache(kv, n, seed=i, pool=pool) for i, n in enumerate([40, 95, 70])]
    memo, q = {}, mx.random.normal((3, 9, 64))

    def check(cs):
        got = _decode_batch(q, cs, 0.125, memo)
        assert mx.allclose(got, _decode_batch(q, cs, 0.125), atol=1e-6, equal_nan=True)
        return got

    check(caches)
    assert memo  # sealed runs were stacked and kept
    for _ in range(30):  # appends; the 70-token row seals its third page on the way
        for c in caches:
            c.update_and_fetch(mx.random.normal((1, 3, 1, 64)), mx.random.normal((1, 3, 1, 64)))
        check(caches)
    other = _filled_cache(kv, caches[1].offset, seed=9, pool=pool)
    _poison([other])
    assert bool(mx.isnan(check([caches[0], other, caches[2]])[1]).any())


def _forked(kv, prefix: int, tails, pool, shared=True):
    """Sequences holding one prefix's pages (forked from it: the same page objects; else written again) and a
    tail of their own each."""
    from justfit.kvexec import fork_caches

    base = _filled_cache(kv, prefix, seed=7, pool=pool, batched=True)
    out = []
    for i, n in enumerate(tails):
        c = fork_caches([base])[0] if shared else _filled_cache(kv, prefix, seed=7, pool=pool, batched=True)
        c.for_batch()
        mx.random.seed(100 + i)
        c.update_and_fetch(mx.random.normal((1, 3, n, 64)), mx.random.normal((1, 3, n, 64)))
        out.append(c)
    return out


@pytest.mark.parametrize("kv", CONFIGS, ids=lambda k: k.name)
def test_shared_prefix_pages_are_read_once_for_every_row(kv):
    """Sealed pages every row shares (a common prefix) are kept once in the memo and scored for all rows in
    one block: each row gets what it gets alone, and the memo holds less than for unshared copies."""
    from justfit.kvexec.batch import memo_nbytes

    pool = PagePool(1, kv.page_size)
    tails = [5, 40, 70]  # the 96-token prefix's 3 pages are shared; the tails seal pages of their own
    shared, copies = _forked(kv, 96, tails, pool), _forked(kv, 96, tails, pool, shared=False)
    q = mx.random.normal((len(tails), 9, 64))
    refs = [paged_attention(q[i][None, :, None], c, 0.125)[0, :, 0] for i, c in enumerate(shared)]
    memo_shared, memo_copies = {}, {}
    got = _decode_batch(q, shared, 0.125, memo_shared)
    same = _decode_batch(q, copies, 0.125, memo_copies)
    for i, ref in enumerate(refs):
        assert mx.allclose(got[i], ref, atol=2e-5, rtol=1e-4), (kv.name, i)
        assert mx.allclose(same[i], ref, atol=2e-5, rtol=1e-4), (kv.name, i)
    assert memo_nbytes(memo_shared) < memo_nbytes(memo_copies)
    mixed = [shared[0], copies[1], shared[2]]  # one row holds its own copy of the prefix now
    fresh = {}
    assert mx.allclose(_decode_batch(q, mixed, 0.125, memo_shared), _decode_batch(q, mixed, 0.125, fresh), atol=1e-5)
    assert memo_nbytes(memo_shared) == memo_nbytes(fresh)  # no stale run of the old layout kept


@pytest.mark.parametrize("kv", CONFIGS[1:], ids=lambda k: k.name)
def test_memo_dequantizes_4bit_pages_within_its_cap(kv, monkeypatch):
    """With room (DEQUANT_TOKENS), the memo keeps sealed 4-bit pages as float32 (read by BLAS, not MLX's CPU
    quantized_matmul): the same output, more bytes; past the cap, or when the caller says no, they stay 4-bit,
    and drop_decoded frees only the float copies."""
    from justfit.kvexec import batch
    from justfit.kvexec.batch import drop_decoded, memo_nbytes

    pool = PagePool(1, kv.page_size)
    caches = [_filled_cache(kv, n, seed=i, pool=pool, batched=True) for i, n in enumerate([70, 150, 453])]
    q = mx.random.normal((3, 9, 64))
    ref = _decode_batch(q, caches, 0.125)  # no memo: every page read in its stored format
    sizes = {}
    for name, dequant, cap in (("floats", True, batch.DEQUANT_TOKENS), ("refused", False, batch.DEQUANT_TOKENS),
                               ("over the cap", True, 100)):
        monkeypatch.setattr(batch, "DEQUANT_TOKENS", cap)
        memo = {}
        got = _decode_batch(q, caches, 0.125, memo, dequant=dequant)
        assert mx.allclose(got, ref, atol=2e-5, rtol=1e-4), (kv.name, name)
        sizes[name] = memo_nbytes(memo)
        if name == "floats":
            drop_decoded(memo)
            assert 0 < memo_nbytes(memo) < sizes["floats"] or kv.quantized_kv_start == 0
    assert sizes["refused"] == sizes["over the cap"] < sizes["floats"]
