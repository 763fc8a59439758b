"""Where a batched decode step goes: B sequences of T tokens on the default model (4-bit pages, for_batch, as
the scheduler runs them) vs mlx-lm's BatchKVCache, steps interleaved; then the same step with attention
stubbed out (the rest of the model), and attention alone over all layers vs mx.fast.scaled_dot_product_attention
on float32 K/V of the same shapes. (session 12, B=4, T=600, two runs of 20: step 151 / 134 vs 107 / 94 ms,
attention stubbed 82 / 69 ms, attention alone 62 / 52 vs 17.7 / 16.6 ms: the gap is attention)

Run: python docs/bench/repro/batch_decode_profile.py 4 600 20
"""
import random
import statistics
import sys
import time

import justfit  # noqa: F401,I001  (before mlx: justfit loads OpenBLAS)
import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

import justfit.kvexec.routing as routing
from justfit.bench import batch as B
from justfit.config import KVConfig
from justfit.kvexec import make_cache
from justfit.kvexec.batch import BatchPlan, _decode_batch, forward

n_seqs, ctx, iters = (int(x) for x in sys.argv[1:4])
model, _ = B._load("default", 0)
kv, rng = KVConfig(), random.Random(0)
prompts = [[rng.randrange(1000, 49000) for _ in range(ctx)] for _ in range(n_seqs)]
seqs = []
for ids in prompts:
    c = make_cache(model, kv)
    for layer in c:
        layer.for_batch()
    c[0].seq.reserve(ctx)
    mx.eval(forward(model, BatchPlan([(c, ctx)]), ids))
    seqs.append(c)
theirs = [BatchKVCache([0] * n_seqs) for _ in model.layers]
mx.eval(model(mx.array(prompts), cache=theirs))
memo = {}


def ours():
    for c in seqs:
        c[0].seq.reserve(c[0].offset + 1)
    mx.eval(mx.argmax(forward(model, BatchPlan([(c, 1) for c in seqs], memo), [42] * n_seqs), axis=-1))
    for c in seqs:
        for layer in c:
            layer.trim(1)


def mlx_lm():
    mx.eval(mx.argmax(model(mx.array([[42]] * n_seqs), cache=theirs)[:, -1], axis=-1))
    for layer in theirs:
        layer.trim(1)


real = routing.batch_attention


def ours_without_attention():
    routing.batch_attention = lambda q, layer, scale, sinks=None: q
    try:
        ours()
    finally:
        routing.batch_attention = real


L, q = len(model.layers), mx.random.normal((n_seqs, 9, 64))
k_f32 = [mx.random.normal((n_seqs, 3, ctx, 64)) for _ in range(L)]
v_f32 = [mx.random.normal((n_seqs, 3, ctx, 64)) for _ in range(L)]
mx.eval(q, k_f32, v_f32)


def attention_alone():
    mx.eval([_decode_batch(q, [c[i] for c in seqs], 0.125, memo) for i in range(L)])


def sdpa_alone():
    mx.eval([mx.fast.scaled_dot_product_attention(q[:, :, None], k, v, scale=0.125) for k, v in zip(k_f32, v_f32)])


timed = {"justfit step": ours, "mlx-lm step": mlx_lm, "justfit step, attention stubbed": ours_without_attention,
         "justfit attention alone": attention_alone, "mlx sdpa alone (float32)": sdpa_alone}
for f in timed.values():
    f()
    f()
times = {n: [] for n in timed}
for i in range(iters):
    for n in (list(timed) if i % 2 == 0 else list(timed)[::-1]):
        t0 = time.perf_counter()
        timed[n]()
        times[n].append(time.perf_counter() - t0)
for n, t in times.items():
    print(f"{n}: {statistics.median(t) * 1e3:.1f} ms [{min(t) * 1e3:.1f}-{max(t) * 1e3:.1f}]")
