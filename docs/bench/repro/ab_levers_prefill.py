"""A/B: prefill tok/s, full default model, mlx-lm fp16 KVCache vs justfit default with/without fast exp and split.
(session 8: which of streams / fast exp / one-page prefill blocks moves the number; in-process, interleaved)

Run: python docs/bench/repro/ab_levers_prefill.py 512,2048 3
"""
import statistics
import sys
import time

import justfit
import mlx.core as mx
from mlx_lm.models.cache import KVCache
from justfit.kvexec import attention, softmax, streams
from justfit.generation import PREFILL_STEP
ctxs = [int(x) for x in sys.argv[1].split(",")]
rounds = int(sys.argv[2])
model, tok = justfit.load("default")
text = open(sys.argv[3]).read() if len(sys.argv) > 3 else " ".join(f"word{i} and more text {i * 7}" for i in range(20000))
ids_all = tok.encode(text)
MAXP, FE = streams.MAX_PARTS, softmax.FAST_EXP_ELEMENTS
BR = attention._block_rows


def big(q, L, P):
    return 1 << 30


systems = {"fp16": None, "jf": (MAXP, FE, BR), "jf-bigblock": (MAXP, FE, big), "jf-noexp": (MAXP, 1 << 62, BR), "jf-nosplit": (1, FE, BR)}
for ctx in ctxs:
    ids = mx.array(ids_all[:ctx])[None]
    t = {n: [] for n in systems}
    names = list(systems)
    for r in range(rounds):
        for n in names[r % len(names):] + names[: r % len(names)]:
            cfg = systems[n]
            if cfg is None:
                cache = [KVCache() for _ in model.layers]
            else:
                streams.MAX_PARTS, softmax.FAST_EXP_ELEMENTS, attention._block_rows = cfg
                cache = justfit.make_cache(model, justfit.KVConfig())
            t0 = time.perf_counter()
            for i in range(0, ctx, PREFILL_STEP):
                h = model.model(ids[:, i : i + PREFILL_STEP], cache=cache)
                mx.eval(h, [c.state for c in cache])
            t[n].append(ctx / (time.perf_counter() - t0))
    b = statistics.median(t["fp16"])
    print(f"prefill {ctx}: " + "  ".join(f"{n} {statistics.median(v):.1f} [{min(v):.1f}-{max(v):.1f}] ({statistics.median(v)/b:.2f}x)" for n, v in t.items()), flush=True)
