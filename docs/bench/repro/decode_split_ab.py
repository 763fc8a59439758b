"""decode.attention (kvexec/decode.py, the memo path) over 30 layers: the 4-bit run split across 2 CPU streams (landed
in session 16) vs one stream (streams.MAX_PARTS = 1), and mlx-lm's SDPA on float32 K/V; medians of interleaved rounds, ms.
Session 16, 15 rounds: 1280 (one part: no split) split 43.4 (33.7-70.7), one 40.0 (34.2-55.5), sdpa 28.7;
2048 split 58.4 (43.3-74.0), one 59.3 (50.1-71.2), sdpa 45.4; 2560 split 63.9 (52.7-85.1), one 71.5 (59.1-83.8), sdpa 55.3.
The 1280 row runs the same code twice: its 8% gap is this machine's noise.

Run: python docs/bench/repro/decode_split_ab.py 1280,2048,2560 15
"""
import statistics, sys, time
import justfit
import mlx.core as mx
from justfit.kvexec import decode, streams

model, _ = justfit.load("default")
L, attn = len(model.layers), model.layers[0].self_attn
H, D, Hq = attn.n_kv_heads, attn.head_dim, attn.n_heads
rounds = int(sys.argv[2])
for ctx in [int(x) for x in sys.argv[1].split(",")]:
    k = mx.random.normal((1, H, ctx, D), key=mx.random.key(1)); v = mx.random.normal((1, H, ctx, D), key=mx.random.key(2))
    new = mx.random.normal((1, H, 1, D), key=mx.random.key(3))
    caches = []
    for _ in range(2):
        c = justfit.make_cache(model, justfit.KVConfig())
        for layer in c:
            layer.update_and_fetch(k, v); layer.update_and_fetch(new, new); layer.settle_window()
        mx.eval([x for layer in c for x in layer.state]); caches.append(c)
    q = mx.random.normal((1, Hq, 1, D))
    kf, vf = mx.concatenate([k, new], 2), mx.concatenate([v, new], 2); mx.eval(kf, vf)
    def run(c, parts):
        streams.MAX_PARTS = parts
        return [decode.attention(q, c[i], 0.125) for i in range(L)]
    fs = {"split": lambda: run(caches[0], 2), "one": lambda: run(caches[1], 1),
          "sdpa": lambda: [mx.fast.scaled_dot_product_attention(q, kf, vf, scale=0.125) for _ in range(L)]}
    print(ctx, "max|split-one|", float(mx.abs(fs["split"]()[0] - fs["one"]()[0]).max()), "memo keys", list(caches[0][0].memo.runs))
    t = {n: [] for n in fs}
    for r in range(rounds):
        for n in list(fs)[r % 3:] + list(fs)[: r % 3]:
            f = fs[n]; mx.eval(f()); t0 = time.perf_counter(); mx.eval(f()); t[n].append((time.perf_counter() - t0) * 1e3)
    print(ctx, "  ".join(f"{n} {statistics.median(x):.1f} ({min(x):.1f}-{max(x):.1f})" for n, x in t.items()), flush=True)
