"""A/B: decode of mlx-lm fp16 vs justfit default with and without the decode memo (kvexec/decode.py), paired
per step: every iteration times one greedy step of each system (rotating order, trimmed back after), and the
speed ratio is the median of the per-iteration ratios, which shared-machine drift affects far less than
medians of separate rounds. (session 10: 2k tokens 0.87-0.88x with the memo vs 0.77-0.81x without)

Run: python docs/bench/repro/ab_decode_memo.py 512,2048 50
"""
import statistics
import sys
import time

import justfit  # noqa: I001  (before mlx: justfit loads OpenBLAS)
import mlx.core as mx
from mlx_lm.models.cache import KVCache

from justfit.kvexec import decode

ctxs = [int(x) for x in sys.argv[1].split(",")]
iterations = int(sys.argv[2]) if len(sys.argv) > 2 else 50
model, _ = justfit.load("default")
attn = model.layers[0].self_attn
H, D = attn.n_kv_heads, attn.head_dim
applies = decode.applies
for ctx in ctxs:
    caches = {"mlx-lm-fp16": [KVCache() for _ in model.layers], "memo": justfit.make_cache(model),
              "no-memo": justfit.make_cache(model)}
    for c in caches.values():
        for i, layer in enumerate(c):
            key = mx.random.key(1000 + i)
            layer.update_and_fetch(mx.random.normal((1, H, ctx, D), key=key),
                                   mx.random.normal((1, H, ctx, D), key=mx.random.split(key)[0]))
        mx.eval([x for layer in c for x in layer.state])
    names, tok = list(caches), mx.array([[42]])
    t = {n: [] for n in names}
    for it in range(iterations + 3):
        for n in names[it % 3:] + names[: it % 3]:
            decode.applies = (lambda *a: False) if n == "no-memo" else applies
            t0 = time.perf_counter()
            mx.eval(mx.argmax(model(tok, cache=caches[n])[:, -1:], axis=-1))
            dt = time.perf_counter() - t0
            for layer in caches[n]:
                layer.trim(1)
            if it >= 3:  # the first steps settle the float window and build the memo
                t[n].append(dt)
    decode.applies = applies
    base = t["mlx-lm-fp16"]
    print(f"ctx {ctx}: " + " ".join(
        f"{n}={statistics.median(b / x for b, x in zip(base, t[n])):.3f}x ({statistics.median(t[n]) * 1e3:.1f} ms)"
        for n in names), flush=True)
