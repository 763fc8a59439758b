"""The x86-64 CPU decode kernel (kvexec/cpu/q4.c): the attention KVExec's MLX path computes, over every page
kind it reads (sealed 4-bit, bfloat16, the float32 open page), for any number of query rows per KV head;
it declines what it does not read, the default model decodes the same tokens with it, and a failed build
leaves MLX's path running."""

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from justfit.config import KVConfig
from justfit.kvexec import PagePool, Sequence, attention, cpu, decode, make_cache
from justfit.kvexec.cache import PagedKVCache
from justfit.kvexec.pages import FULL, OPEN, QUANT

pytestmark = pytest.mark.skipif(cpu.library() is None, reason=f"the CPU kernel does not run here: {cpu.status()}")
P = 64


def _cache(H, **kw):
    kv = KVConfig(**{"page_size": P, "quantized_kv_start": P, **kw})
    return PagedKVCache(Sequence(PagePool(1, P)), 0, kv)


def _filled(n, H, rep, D, seed=0, **kw):
    """A cache holding n tokens then one decode token, and that token's queries [1, H*rep, 1, D]."""
    rng = np.random.default_rng(seed)
    k, v = (mx.array(rng.standard_normal((1, H, n + 1, D)).astype(np.float32)) for _ in "kv")
    cache = _cache(H, **kw)
    cache.update_and_fetch(k[:, :, :n], v[:, :, :n])
    cache.update_and_fetch(k[:, :, n:], v[:, :, n:])
    return cache, mx.array(rng.standard_normal((1, H * rep, 1, D)).astype(np.float32))


@pytest.mark.parametrize("n", [200, 255, 300, 511])
@pytest.mark.parametrize("rep", [1, 3, 4, 7])
@pytest.mark.parametrize("D", [64, 128])
def test_kernel_equals_the_mlx_path(n, rep, D):
    cache, q = _filled(n, 2, rep, D, seed=n + rep)
    before = cpu.CALLS["decode"]
    got = decode.kernel_attention(q, cache, 0.125)
    assert got is not None and cpu.CALLS["decode"] == before + 1
    kinds = {p.kind for _, _, p in cache.attended_pages()}
    assert QUANT in kinds and (OPEN in kinds) == ((n + 1) % P != 0)  # 4-bit pages read; an open one if any
    np.testing.assert_allclose(np.array(got), np.array(attention._attend(q, cache, 0.125, None, None)),
                               atol=2e-5, rtol=1e-4)


def test_pages_read_without_a_float_window_and_a_nearly_full_open_page():
    cache, q = _filled(P * 4 - 2, 2, 3, 64, float_pages=0)  # 63 of the open page's 64 slots written
    assert [p.kind for _, _, p in cache.attended_pages()] == [FULL, QUANT, QUANT, OPEN]
    got = decode.kernel_attention(q, cache, 0.125)
    np.testing.assert_allclose(np.array(got), np.array(attention._attend(q, cache, 0.125, None, None)),
                               atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kw", [dict(bits=16), dict(format="rotated"), dict(key_bits=8), dict(key_format="affine")])
def test_formats_it_does_not_read_take_the_mlx_path(kw):
    cache, q = _filled(300, 2, 3, 64, **kw)
    assert decode.kernel_attention(q, cache, 0.125) is None
    np.testing.assert_allclose(np.array(attention.paged_attention(q, cache, 0.125)),
                               np.array(attention._attend(q, cache, 0.125, None, None)), atol=2e-6, rtol=1e-5)


def test_a_partial_sealed_page_and_a_short_context_take_the_mlx_path():
    cache, q = _filled(300, 2, 3, 64)
    cache.trim(200)  # 101 tokens: the second page is cut, sealed and partial
    cache.update_and_fetch(*(mx.zeros((1, 2, 1, 64)) for _ in "kv"))
    assert decode.kernel_attention(q, cache, 0.125) is None
    short, q2 = _filled(100, 2, 3, 64)  # only float pages: MLX's fused path, no synchronization
    assert decode.kernel_attention(q2, short, 0.125) is None


def test_default_model_decodes_the_same_tokens(shallow, monkeypatch):
    shallow.phaseswap.enter("decode")
    model = shallow.model
    ids = [int(i) for i in np.random.default_rng(3).integers(100, 40000, 1100)]  # several sealed 4-bit pages

    def greedy(n=8):
        caches = make_cache(model, KVConfig())
        logits = model(mx.array(ids)[None], cache=caches)[0, -1]
        out, steps = [], []
        for _ in range(n):
            steps.append(logits)
            out.append(int(mx.argmax(logits)))
            logits = model(mx.array([[out[-1]]]), cache=caches)[0, -1]
        return out, mx.stack(steps)

    before = cpu.CALLS["decode"]
    tokens, logits = greedy()
    assert cpu.CALLS["decode"] - before == 8 * len(model.layers)  # every layer of every step
    monkeypatch.setenv("JUSTFIT_CPU_KERNELS", "0")
    ref_tokens, ref_logits = greedy()
    assert cpu.CALLS["decode"] - before == 8 * len(model.layers)
    assert tokens == ref_tokens
    assert float(mx.abs(logits - ref_logits).max()) < 2e-3


def _status(tmp_path, **env):
    code = "from justfit.kvexec import cpu; print(cpu.status()); print(cpu.library() is None)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "JUSTFIT_HOME": str(tmp_path), **env})
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_a_failed_build_or_the_switch_leaves_mlx_running(tmp_path):
    status, none = _status(tmp_path, CC="false")
    assert status.startswith("off (build failed") and none == "True"
    assert not list((tmp_path / "kernels").glob("*.so"))  # nothing half-written is left to load later
    status, _ = _status(tmp_path, JUSTFIT_CPU_KERNELS="0")
    assert status == "off (JUSTFIT_CPU_KERNELS=0)"
    status, none = _status(tmp_path)
    assert status == "on" and none == "False" and len(list((tmp_path / "kernels").glob("q4-*.so"))) == 1


def test_strided_and_bfloat16_arrays_reach_the_kernel_as_their_values():
    a = mx.arange(32, dtype=mx.float32).reshape(4, 8)
    for x in (a.T, a.astype(mx.bfloat16).T, a.astype(mx.bfloat16)[:, ::2]):  # strided views, as seals make
        mx.eval(x)
        host = cpu._host(x)
        assert host.flags.c_contiguous and host.shape == tuple(x.shape)
        values = host if x.dtype == mx.float32 else (host.astype(np.uint32) << 16).view(np.float32)
        np.testing.assert_array_equal(values, np.array(x.astype(mx.float32)))


def test_batched_decode_equals_the_mlx_path_and_reads_each_sequence_alone():
    from justfit.kvexec.batch import _decode_batch

    pool, H, rep, D = PagePool(1, P), 2, 3, 64
    kv = KVConfig(page_size=P, quantized_kv_start=P)
    caches, rng = [], np.random.default_rng(7)
    for n in (130, 200, 333, 64 * 5 - 1):  # different lengths, open pages of different fill (none for the last)
        c = PagedKVCache(Sequence(pool), 0, kv)
        c.for_batch()  # batched serving: no float window, 16-bit open pages
        k, v = (mx.array(rng.standard_normal((1, H, n + 1, D)).astype(np.float32)) for _ in "kv")
        c.update_and_fetch(k, v)
        caches.append(c)
    q = mx.array(rng.standard_normal((len(caches), H * rep, D)).astype(np.float32))
    got = decode.kernel_attention_batch(q, caches, 0.125)
    assert got is not None
    np.testing.assert_allclose(np.array(got), np.array(_decode_batch(q, caches, 0.125)), atol=2e-5, rtol=1e-4)
    # each row is its own sequence's attention: the same computed with that sequence alone
    alone = decode.kernel_attention_batch(q[1:2], caches[1:2], 0.125)
    np.testing.assert_allclose(np.array(got[1:2]), np.array(alone), atol=1e-6)
    short = PagedKVCache(Sequence(pool), 0, kv)  # no sealed 4-bit page yet: the batch runs MLX's path
    short.for_batch()
    short.update_and_fetch(*(mx.array(rng.standard_normal((1, H, 40, D)).astype(np.float32)) for _ in "kv"))
    q5 = mx.array(rng.standard_normal((len(caches) + 1, H * rep, D)).astype(np.float32))
    assert decode.kernel_attention_batch(q5, caches + [short], 0.125) is None


def test_batched_engine_decodes_through_the_kernel_with_no_float_copies(shallow):
    """The scheduler's batched decode on the default config: once every decoder has a sealed 4-bit page, each
    layer of each batched step is one kernel call, no float copy of a page is kept, and each request's tokens
    are what its sequence alone picks when fed the same tokens (caches in batched mode from the start, as
    both were admitted together): its argmax, or within 0.05 of it (random-id prompts have near-ties that
    rounding flips: 0.016 apart at one step with these ids, with or without the kernel)."""
    from justfit.kvexec.batch import memo_nbytes
    from justfit.engine import Engine

    model, kv, rng = shallow.model, KVConfig(), np.random.default_rng(11)
    ids = [[int(i) for i in rng.integers(100, 40000, n)] for n in (560, 610)]  # one sealed 4-bit page each
    eng = Engine(model, shallow.tokenizer, lambda: make_cache(model, kv), kv=kv)
    reqs = [eng.submit(p, max_tokens=6) for p in ids]
    before, kept = cpu.CALLS["decode"], 0
    while not all(r.done for r in reqs):
        eng.step()
        kept = max(kept, memo_nbytes(eng.kv.stacks))
    assert cpu.CALLS["decode"] - before >= 4 * len(model.layers)  # at least 4 batched decode steps
    assert kept == 0
    for p, r in zip(ids, reqs):
        tokens, caches = r.result().tokens, make_cache(model, kv)
        for layer in caches:
            layer.for_batch()
        logits = model(mx.array(p)[None], cache=caches)[0, -1]
        for t in tokens:
            assert float(logits[t]) >= float(logits.max()) - 0.05
            logits = model(mx.array([[t]]), cache=caches)[0, -1]


def test_kernel_served_steps_publish_their_tokens_without_computing_the_next_pass(shallow, monkeypatch):
    """Where the kernel serves batched decode, a step computes its own pass only: the kernel evaluates while a
    pass is built, so queueing the next one would compute it before this step's tokens are published (each a
    step late). After every step each running request's pages hold its prompt and all its tokens but the last
    published one, which the next pass feeds; without the kernel the next pass is queued (fed one more)."""
    from justfit.engine import Engine

    model, kv, rng = shallow.model, KVConfig(), np.random.default_rng(12)
    prompts = [[int(i) for i in rng.integers(100, 40000, 530)] for _ in range(2)]  # one sealed 4-bit page each

    def ahead_of_published(env):
        """Per step, tokens each running request's caches hold beyond prompt + published - 1."""
        monkeypatch.setenv("JUSTFIT_CPU_KERNELS", env)  # restored after the test, whatever it was before
        eng = Engine(model, shallow.tokenizer, lambda: make_cache(model, kv), kv=kv)
        reqs, seen, before = [eng.submit(p, max_tokens=6) for p in prompts], set(), cpu.CALLS["decode"]
        while not all(r.done for r in reqs):
            eng.step()
            seen |= {r.caches[0].offset - (len(r.prompt) + len(r.out) - 1) for r in reqs if r.out and not r.done}
        return seen, cpu.CALLS["decode"] - before

    seen, calls = ahead_of_published("1")
    assert calls >= 3 * len(model.layers) and seen == {0}
    seen, calls = ahead_of_published("0")
    assert calls == 0 and 1 in seen


def test_generation_on_the_kernel_yields_each_token_before_feeding_it_and_feeds_it_on_close(shallow):
    """A lone request on caller-owned caches decoding through the kernel: each token is emitted as soon as it is
    read, before the step that feeds it (that step computes while it is built, so building it first would show
    the token a step late); a caller that stops early still leaves every token it saw in the cache."""
    from justfit.engine import Engine

    model, L = shallow.model, len(shallow.model.layers)
    ids = [int(i) for i in np.random.default_rng(13).integers(100, 40000, 800)]  # a 4-bit page past the float one
    for stop_after in (5, None):
        cache, before, calls = make_cache(model, KVConfig()), cpu.CALLS["decode"], []
        eng = Engine(model, shallow.tokenizer, lambda: make_cache(model, KVConfig()), eos=set())
        req = eng.submit(ids, 8, caches=cache)
        out = []
        for chunk in req:
            out.append(chunk.token)
            calls.append(cpu.CALLS["decode"] - before)
            if len(out) == stop_after:
                req.cancel()
                break
        assert calls == [(k + 1) * L for k in range(len(out))]  # the passes that computed tokens 0..k, no more
        assert cache[0].offset == len(ids) + len(out) == len(ids) + (stop_after or 8)


def test_threaded_calls_give_the_single_thread_result_bit_for_bit(monkeypatch):
    """A call past THREAD_WORK deals its (sequence, head) items to threads, each with its own scratch: every
    item computes what one thread computes, so outputs are identical, for ragged sequences of every page kind."""
    pool, H, rep, D = PagePool(1, P), 3, 3, 64
    kv, rng, caches = KVConfig(page_size=P, quantized_kv_start=P), np.random.default_rng(9), []
    for n in (1700, 130, 1500, 64 * 9):
        c = PagedKVCache(Sequence(pool), 0, kv)
        c.for_batch()
        c.update_and_fetch(*(mx.array(rng.standard_normal((1, H, n, D)).astype(np.float32)) for _ in "kv"))
        caches.append(c)
    q = mx.array(rng.standard_normal((len(caches), H * rep, D)).astype(np.float32))
    monkeypatch.delenv("JUSTFIT_CPU_THREADS", raising=False)
    assert cpu.threads((1700 + 130 + 1500 + 576) * H * rep, len(caches) * H) == min(len(os.sched_getaffinity(0)), 12)
    monkeypatch.setenv("JUSTFIT_CPU_THREADS", "1")
    one = np.array(decode.kernel_attention_batch(q, caches, 0.125))
    for n in ("2", "3", "16"):
        monkeypatch.setenv("JUSTFIT_CPU_THREADS", n)
        np.testing.assert_array_equal(np.array(decode.kernel_attention_batch(q, caches, 0.125)), one)
    assert cpu.threads(cpu.THREAD_WORK - 1, 12) == 1
