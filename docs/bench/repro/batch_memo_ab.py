"""Paired step A/B of batched decode: the memo with 4-bit pages dequantized to float32 vs kept 4-bit, mlx-lm's
BatchKVCache beside; B sequences of T tokens forked from one S-token prefix (their shared pages: one copy in
the memo). Medians of interleaved rounds, min-max. (session 14: 4 x 600, S=256, 15 rounds: 0.91x the step
time with float copies; memo 59 vs 19 MB; the step 1.17x mlx-lm's, 1.33x without them)

Run: python docs/bench/repro/batch_memo_ab.py 4 600 15 256
"""
import random
import statistics
import sys
import time

import justfit  # noqa: F401,I001  (before mlx: justfit loads OpenBLAS)
import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from justfit.bench import batch as B
from justfit.config import KVConfig
from justfit.kvexec import fork_caches, make_cache
from justfit.kvexec import batch as kb

n_seqs, ctx, rounds, shared = (int(x) for x in sys.argv[1:5])
model, _ = B._load("default", 0)
rng = random.Random(0)
prefix = [rng.randrange(1000, 49000) for _ in range(shared)]
prompts = [prefix + [rng.randrange(1000, 49000) for _ in range(ctx - shared)] for _ in range(n_seqs)]


def batched(caches):
    for layer in caches:
        layer.for_batch()
    return caches


base = batched(make_cache(model, KVConfig()))
base[0].seq.reserve(shared)
mx.eval(kb.forward(model, kb.BatchPlan([(base, shared)]), prefix))
seqs = []
for ids in prompts:
    c = batched(fork_caches(base))
    c[0].seq.reserve(ctx)
    mx.eval(kb.forward(model, kb.BatchPlan([(c, ctx - shared)]), ids[shared:]))
    seqs.append(c)
theirs = [BatchKVCache([0] * n_seqs) for _ in model.layers]
mx.eval(model(mx.array(prompts), cache=theirs))
memos = {True: {}, False: {}}


def ours(dequant):
    for c in seqs:
        c[0].seq.reserve(c[0].offset + 1)
    plan = kb.BatchPlan([(c, 1) for c in seqs], memos[dequant], dequant)
    mx.eval(mx.argmax(kb.forward(model, plan, [42] * n_seqs), axis=-1))
    for c in seqs:
        for layer in c:
            layer.trim(1)


def mlx_lm():
    mx.eval(mx.argmax(model(mx.array([[42]] * n_seqs), cache=theirs)[:, -1], axis=-1))
    for layer in theirs:
        layer.trim(1)


steps = {"float copies": lambda: ours(True), "4-bit copies": lambda: ours(False), "mlx-lm": mlx_lm}
for f in steps.values():
    f()
    f()
times = {name: [] for name in steps}
for i in range(rounds):
    for name in (list(steps) if i % 2 == 0 else list(steps)[::-1]):
        t0 = time.perf_counter()
        steps[name]()
        times[name].append(time.perf_counter() - t0)
for name, t in times.items():
    print(f"{name}: {statistics.median(t) * 1e3:.1f} ms [{min(t) * 1e3:.1f}-{max(t) * 1e3:.1f}]")
for a, b in (("float copies", "4-bit copies"), ("float copies", "mlx-lm"), ("4-bit copies", "mlx-lm")):
    print(f"{a} / {b}: {statistics.median(x / y for x, y in zip(times[a], times[b])):.3f}")
print(f"memo MB: float copies {kb.memo_nbytes(memos[True]) / 1e6:.1f}, 4-bit {kb.memo_nbytes(memos[False]) / 1e6:.1f}")
