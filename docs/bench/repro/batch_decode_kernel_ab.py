"""A/B: one batched decode step (B sequences of T tokens, default model, 4-bit pages as the scheduler runs them)
with the CPU kernel (kvexec/cpu, kernel_attention_batch) vs without it (JUSTFIT_CPU_KERNELS=0: the dequantized
stack while the batch holds at most DEQUANT_TOKENS sealed 4-bit tokens, else MLX's quantized matmul) vs mlx-lm's
BatchKVCache; steps interleaved, each system on its own caches, the step's token trimmed back after; medians
with min-max. The kernel serves once every sequence has a sealed 4-bit page (T > 512 with the default config).

Run: python docs/bench/repro/batch_decode_kernel_ab.py 4 4096 12
"""
import os
import random
import statistics
import sys
import time

import justfit  # noqa: F401,I001  (before mlx: justfit loads OpenBLAS)
import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from justfit.bench import batch as B
from justfit.config import KVConfig
from justfit.kvexec import cpu, make_cache
from justfit.kvexec.batch import BatchPlan, forward

n_seqs, ctx, iters = (int(x) for x in sys.argv[1:4])
model, _ = B._load("default", 0)
kv, rng = KVConfig(), random.Random(0)
prompts = [[rng.randrange(1000, 49000) for _ in range(ctx)] for _ in range(n_seqs)]


def paged():
    seqs = []
    for ids in prompts:
        c = make_cache(model, kv)
        for layer in c:
            layer.for_batch()
        for s in range(0, ctx, 512):  # prefill in chunks, as the scheduler does
            c[0].seq.reserve(min(ctx, s + 512))
            mx.eval(forward(model, BatchPlan([(c, min(512, ctx - s))]), ids[s:s + 512]))
        seqs.append(c)
    return seqs


systems = {"justfit-kernel": (paged(), {}, "1"), "justfit-mlx": (paged(), {}, "0")}
theirs = [BatchKVCache([0] * n_seqs) for _ in model.layers]
mx.eval(model(mx.array(prompts), cache=theirs))


def ours(name):
    seqs, memo, flag = systems[name]
    os.environ["JUSTFIT_CPU_KERNELS"] = flag
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


timed = {"justfit-kernel": lambda: ours("justfit-kernel"), "justfit-mlx": lambda: ours("justfit-mlx"),
         "mlx-lm-batch": mlx_lm}
for f in timed.values():
    f()
calls = cpu.CALLS["decode"]
times = {n: [] for n in timed}
for i in range(iters):
    names = list(timed)
    for n in names[i % 3:] + names[:i % 3]:
        t0 = time.perf_counter()
        timed[n]()
        times[n].append(time.perf_counter() - t0)
base = statistics.median(times["mlx-lm-batch"])
print(f"B={n_seqs} T={ctx}: " + " ".join(f"{n}={statistics.median(t) * 1e3:.0f} ms ({min(t) * 1e3:.0f}-{max(t) * 1e3:.0f},"
      f" {base / statistics.median(t):.2f}x)" for n, t in times.items()) + f"; kernel calls {cpu.CALLS['decode'] - calls}")
