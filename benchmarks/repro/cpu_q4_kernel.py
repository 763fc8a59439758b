"""A/B: one decode step of the default model, mlx-lm's fp16 KVCache vs justfit's default 4-bit pages with the
x86-64 CPU kernel (kvexec/cpu/q4.c) and without it (JUSTFIT_CPU_KERNELS=0: MLX's quantized matmul), paired per
step: each iteration times one step of every system in rotating order and trims the token back, so all see
the same context; medians with min-max. Also checks that the two justfit paths give the same logits.

Run: python benchmarks/repro/cpu_q4_kernel.py 512,2048,8192,16384 12
"""
import os
import statistics
import sys
import time

import justfit  # noqa: I001  (before mlx: OpenBLAS)
import mlx.core as mx
from mlx_lm.models.cache import KVCache

from justfit.kvexec import cpu

ctxs = [int(x) for x in sys.argv[1].split(",")]
iters = int(sys.argv[2]) if len(sys.argv) > 2 else 12
model, _ = justfit.load("default")
attn = model.layers[0].self_attn
H, D = attn.n_kv_heads, attn.head_dim
print("cpu kernel:", cpu.status())
for ctx in ctxs:
    caches = {"mlx-lm-fp16": [KVCache() for _ in model.layers], "justfit-kernel": justfit.make_cache(model),
              "justfit-mlx-qmm": justfit.make_cache(model)}
    for c in caches.values():
        for i, layer in enumerate(c):
            key = mx.random.key(1000 + i)
            layer.update_and_fetch(mx.random.normal((1, H, ctx, D), key=key),
                                   mx.random.normal((1, H, ctx, D), key=mx.random.split(key)[0]))
        mx.eval([x for layer in c for x in layer.state])
    names, times, outs, diff = list(caches), {n: [] for n in caches}, {}, 0.0
    calls = cpu.CALLS["decode"]
    for it in range(iters):
        for n in names[it % 3:] + names[:it % 3]:
            os.environ["JUSTFIT_CPU_KERNELS"] = "0" if n == "justfit-mlx-qmm" else "1"
            t0 = time.perf_counter()
            outs[n] = model(mx.array([[42 + it]]), cache=caches[n])
            mx.eval(outs[n])
            times[n].append(time.perf_counter() - t0)
            for layer in caches[n]:
                layer.trim(1)
        diff = max(diff, mx.abs(outs["justfit-kernel"] - outs["justfit-mlx-qmm"]).max().item())
    base = statistics.median(times["mlx-lm-fp16"])
    row = " ".join(f"{n}={statistics.median(t) * 1e3:.1f} ms ({min(t) * 1e3:.1f}-{max(t) * 1e3:.1f}, "
                   f"{base / statistics.median(t):.2f}x)" for n, t in times.items())
    print(f"ctx {ctx}: {row}; kernel calls {cpu.CALLS['decode'] - calls}; max |logit difference| {diff:.1e}", flush=True)
    del caches
