"""A/B of the CPU kernel's threads (JUSTFIT_CPU_THREADS=1 vs this machine's CPUs) end to end, interleaved.

single: one sequence of `context` random ids on the default model (default KVConfig), then rounds of 16 greedy
decode steps, alternating the arms; median seconds a step. batch: `justfit bench batch`'s workload through the
scheduler (prompts sharing min(1024, P/2) tokens, `gen` greedy tokens), alternating arms each round.

micro: one layer's kernel call alone (`decode.kernel_attention_batch`) on random K/V in batched-mode caches
(default model shapes: 3 KV heads x 3 query rows, head dim 64; `wide`: 8 x 4, 128), 7 rounds of 10 calls.

Run: python benchmarks/repro/cpu_kernel_threads_ab.py single 16384 5
     python benchmarks/repro/cpu_kernel_threads_ab.py batch 8x2048 3 32
     python benchmarks/repro/cpu_kernel_threads_ab.py micro 16x512,16x4096,1x2048,1x16384,16x4096wide 7
"""
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import justfit  # noqa: F401  (before mlx: justfit loads OpenBLAS)
import mlx.core as mx

from justfit.bench import batch as B
from justfit.config import KVConfig
from justfit.kvexec import cpu, make_cache

mode, shape, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
arms = {"1-thread": "1", f"{len(os.sched_getaffinity(0))}-threads": str(len(os.sched_getaffinity(0)))}
if mode == "micro":
    import numpy as np

    from justfit.kvexec import PagePool, Sequence, decode
    from justfit.kvexec.cache import PagedKVCache

    for spec in shape.split(","):
        wide = spec.endswith("wide")
        b, n = (int(x) for x in spec.removesuffix("wide").split("x"))
        H, rep, D = (8, 4, 128) if wide else (3, 3, 64)
        pool, rng, caches = PagePool(1, 256), np.random.default_rng(0), []
        for _ in range(b):
            c = PagedKVCache(Sequence(pool), 0, KVConfig())
            c.for_batch()
            c.update_and_fetch(*(mx.array(rng.standard_normal((1, H, n, D)).astype(np.float32)) for _ in "kv"))
            mx.eval(c.state)
            caches.append(c)
        q = mx.array(rng.standard_normal((b, H * rep, D)).astype(np.float32))
        res = {a: [] for a in arms}
        for i in range(rounds):
            for a in list(arms)[i % 2:] + list(arms)[:i % 2]:
                os.environ["JUSTFIT_CPU_THREADS"] = arms[a]
                t = time.perf_counter()
                for _ in range(10):
                    assert decode.kernel_attention_batch(q, caches, 0.125) is not None
                res[a].append((time.perf_counter() - t) / 10)
        print(f"micro {spec}: " + ", ".join(f"{a} {statistics.median(x) * 1e3:.2f} ms a layer ({min(x) * 1e3:.2f}-"
                                            f"{max(x) * 1e3:.2f})" for a, x in res.items()), flush=True)
    sys.exit(0)


def fill(model, cache, ids, chunk=2048):
    """Prefill ids into the caches in chunks through the decoder stack (no LM head), as a prompt would."""
    for start in range(0, len(ids), chunk):
        model.model(mx.array([ids[start:start + chunk]]), cache=cache)
        mx.eval([x for c in cache for x in c.state])


model, tok = B._load("default", 0)
kv, rng, vocab = KVConfig(), random.Random(3), int(model.args.vocab_size)
res = {a: [] for a in arms}
if mode == "single":
    n = int(shape)
    cache = make_cache(model, kv)
    fill(model, cache, [rng.randrange(1000, vocab) for _ in range(n)])
    y = mx.array([[rng.randrange(1000, vocab)]])
    for i in range(rounds):
        for a in list(arms)[i % 2:] + list(arms)[:i % 2]:
            os.environ["JUSTFIT_CPU_THREADS"] = arms[a]
            times, before = [], cpu.CALLS["decode"]
            for _ in range(16):
                t = time.perf_counter()
                y = mx.argmax(model(y, cache=cache)[:, -1], axis=-1, keepdims=True)
                mx.eval(y)
                times.append(time.perf_counter() - t)
            res[a].append(statistics.median(times))
            print(f"round {i + 1} {a}: {res[a][-1] * 1e3:.1f} ms a step, kernel calls {cpu.CALLS['decode'] - before}",
                  flush=True)
    for a in arms:
        xs = res[a]
        print(f"SUMMARY single {n} {a}: {statistics.median(xs) * 1e3:.1f} ms a step ({min(xs) * 1e3:.1f}-"
              f"{max(xs) * 1e3:.1f}), {1 / statistics.median(xs):.2f} tok/s", flush=True)
else:
    c, P = (int(x) for x in shape.split("x"))
    gen = int(sys.argv[4])
    with tempfile.TemporaryDirectory() as tmp:
        B.run_justfit(model, tok, kv, Path(tmp) / "w", B._prompts(rng, 2, 64, 32, vocab), 4)
        for i in range(rounds):
            prompts = B._prompts(rng, c, P, min(1024, P // 2), vocab)
            for a in list(arms)[i % 2:] + list(arms)[:i % 2]:
                os.environ["JUSTFIT_CPU_THREADS"] = arms[a]
                r = B.run_justfit(model, tok, kv, Path(tmp) / f"{a}{i}", prompts, gen)
                res[a].append(r)
                print(f"round {i + 1} {a}: {r['throughput_tok_s']:.2f} tok/s, itl p50 {r['itl_p50_s'] * 1e3:.0f} ms, "
                      f"ttft p50 {r['ttft_p50_s']:.1f} s", flush=True)
    for a in arms:
        cells = []
        for k in ("throughput_tok_s", "itl_p50_s", "ttft_p50_s"):
            xs = [r[k] for r in res[a]]
            cells.append(f"{k} {statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})")
        print(f"SUMMARY batch {shape} {a}: " + ", ".join(cells), flush=True)
