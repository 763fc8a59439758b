"""Per-op profile of single-query decode attention at 2k tokens (default model, default KVConfig, 30 layers):
the memo path (kvexec/decode.py) vs mlx-lm's SDPA on float32 K/V, and its parts: 4-bit key scores and value mix
(quantized_matmul) vs the same GEMVs on float32 copies, the softmax, the float run (first page + window copy).
Medians of 9 interleaved rounds, min-max, in ms for all 30 layers.

Run: python benchmarks/repro/decode_2k_profile.py
"""
import statistics
import time

import justfit  # noqa: F401,I001  (before mlx: justfit loads OpenBLAS)
import mlx.core as mx

from justfit.kvexec import decode
from justfit.kvexec.pages import FULL, QUANT

model, _ = justfit.load("default")
L, attn = len(model.layers), model.layers[0].self_attn
H, D, Hq, ctx = attn.n_kv_heads, attn.head_dim, attn.n_heads, 2048
cache = justfit.make_cache(model, justfit.KVConfig())
k, v = mx.random.normal((1, H, ctx, D)), mx.random.normal((1, H, ctx, D))
new = mx.random.normal((1, H, 1, D))
for layer in cache:
    layer.update_and_fetch(k, v)
    layer.update_and_fetch(new, new)
    layer.settle_window()
q = mx.random.normal((1, Hq, 1, D))
for layer in cache:
    decode.attention(q, layer, 0.125)  # builds each layer's memo
kf, vf = mx.concatenate([k, new], 2), mx.concatenate([v, new], 2)
qr = q.reshape(H, Hq // H, D)
kq, vq = cache[0].memo.runs[QUANT][1]
kfl, _ = cache[0].memo.runs[FULL][1]
ck, cv = cache[0].codecs
s = ck.scores(qr, kq)
p = mx.softmax(s, axis=-1)
kd, vd = ck.decode(kq), cv.decode(vq)
mx.eval(kf, vf, kq, vq, kfl, s, p, kd, vd, [x for layer in cache for x in layer.state])
full = cache[0].full[0]
fs = {
    "memo path": lambda: [decode.attention(q, cache[i], 0.125) for i in range(L)],
    "sdpa": lambda: [mx.fast.scaled_dot_product_attention(q, kf, vf, scale=0.125) for _ in range(L)],
    "qscore": lambda: [ck.scores(qr, kq) for _ in range(L)],
    "qmix": lambda: [cv.mix(p, vq) for _ in range(L)],
    "fscore": lambda: [qr @ kd.swapaxes(-1, -2) for _ in range(L)],
    "fmix": lambda: [p @ vd for _ in range(L)],
    "softmax": lambda: [mx.softmax(s, axis=-1, precise=True) for _ in range(L)],
    "floatrun": lambda: [full.scores(qr, kfl) for _ in range(L)],
}
t = {n: [] for n in fs}
for _ in range(9):
    for n, f in fs.items():
        mx.eval(f())
        t0 = time.perf_counter()
        mx.eval(f())
        t[n].append((time.perf_counter() - t0) * 1e3)
for n, xs in t.items():
    print(f"{n}: {statistics.median(xs):.1f} ms ({min(xs):.1f}-{max(xs):.1f})")
