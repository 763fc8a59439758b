"""A/B: decode tok/s of mlx-lm fp16 vs justfit default with attention on 1 stream vs split across streams.
(session 8: which of streams / fast exp moves the number; in-process, interleaved)

Run: python docs/bench/repro/ab_levers_decode.py 512,2048,8192 5 6
"""
import statistics
import sys
import time

import justfit
import mlx.core as mx
from mlx_lm.models.cache import KVCache
from justfit.kvexec import softmax, streams
ctxs = [int(x) for x in sys.argv[1].split(",")]
rounds, steps = int(sys.argv[2]), int(sys.argv[3])
model, _ = justfit.load("default")
MAXP, FE = streams.MAX_PARTS, softmax.FAST_EXP_ELEMENTS
L = len(model.layers)
attn = model.layers[0].self_attn
H, D = attn.n_kv_heads, attn.head_dim
for ctx in ctxs:
    caches = {"fp16": [KVCache() for _ in range(L)], "jf": justfit.make_cache(model, justfit.KVConfig())}
    for c in caches.values():
        for i, layer in enumerate(c):
            key = mx.random.key(1000 + i)
            layer.update_and_fetch(mx.random.normal((1, H, ctx, D), key=key), mx.random.normal((1, H, ctx, D), key=mx.random.split(key)[0]))
        mx.eval([x for layer in c for x in layer.state])
    systems = [("fp16", "fp16", None), ("jf", "jf", (MAXP, FE)), ("jf-noexp", "jf", (MAXP, 1 << 62)), ("jf-nosplit", "jf", (1, FE)), ("jf-neither", "jf", (1, 1 << 62))]
    t = {n: [] for n, _, _ in systems}
    for r in range(rounds):
        for n, cn, cfg in systems[r % 5:] + systems[:r % 5]:
            if cfg:
                streams.MAX_PARTS, softmax.FAST_EXP_ELEMENTS = cfg
            c, tok = caches[cn], mx.array([[42]])
            mx.eval(model(tok, cache=c))
            t0 = time.perf_counter()
            for _ in range(steps):
                tok = mx.argmax(model(tok, cache=c)[:, -1:], axis=-1)
                mx.eval(tok)
            t[n].append(steps / (time.perf_counter() - t0))
    b = statistics.median(t["fp16"])
    print(f"ctx {ctx}: " + "  ".join(f"{n} {statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}] ({statistics.median(v)/b:.2f}x)" for n, v in t.items()), flush=True)
