"""A/B: single-sequence decode of mlx-lm fp16 vs justfit default with the decode memo's sealed 4-bit run kept
as it is (4-bit codes read by quantized_matmul) or dequantized once per seal to bfloat16 or float32 (read by
BLAS); paired per step as ab_decode_memo.py. Asks how much of the decode gap the 4-bit reads are.
(session 12, 40 iterations, two runs (the first with an equivalent earlier script): at 2k tokens q4 0.889 /
0.888x, bf16 0.952 / 0.949x, f32 0.952 / 0.994x mlx-lm fp16; at 1k 0.827 / 0.834x, 0.863 / 0.886x, 0.876 /
0.873x; memo 22 / 45 / 80 MB on the 30 layers at 2k. bf16 moved logits by up to 0.47 on these random K/V,
float32 by 2e-5. So the 4-bit reads are ~6-11% of a 2k step; float32 reads reach 0.95-0.99x, and what remains
is op count. Not landed: the float32 copy costs as much memory as mlx-lm's whole cache.)

Run: python docs/bench/repro/ab_dequantized_memo.py 1024,2048 40
"""
import statistics
import sys
import time

import justfit  # noqa: I001  (before mlx: justfit loads OpenBLAS)
import mlx.core as mx
from mlx_lm.models.cache import KVCache

from justfit.kvexec import decode
from justfit.kvexec.formats import concat_parts
from justfit.kvexec.pages import QUANT

DTYPES = {"bf16": mx.bfloat16, "f32": mx.float32}
real_get, stored = decode.RunMemo.get, {}  # memo -> the layer's real 4-bit codecs


def get(self, kind, pages, codecs):
    """The sealed 4-bit run dequantized once into the memo's dtype (this A/B's variant caches only)."""
    if kind != QUANT or id(self) not in stored:
        return real_get(self, kind, pages, codecs)
    (ck, cv), dtype = stored[id(self)]
    held = self.runs.get(kind)
    if held is None or len(held[0]) != len(pages) or any(a is not b for a, b in zip(pages, held[0])):
        parts = [concat_parts([p.parts()[w] for p in pages]) for w in (0, 1)]
        held = self.runs[kind] = (tuple(pages), tuple((c.decode(x).astype(dtype),) for c, x in zip((ck, cv), parts)))
    return held[1]


decode.RunMemo.get = get
ctxs = [int(x) for x in sys.argv[1].split(",")]
iterations = int(sys.argv[2]) if len(sys.argv) > 2 else 40
model, _ = justfit.load("default")
attn = model.layers[0].self_attn
H, D = attn.n_kv_heads, attn.head_dim
for ctx in ctxs:
    caches = {"mlx-lm-fp16": [KVCache() for _ in model.layers], "q4": justfit.make_cache(model),
              "bf16": justfit.make_cache(model), "f32": justfit.make_cache(model)}
    for name, c in caches.items():
        for i, layer in enumerate(c):
            key = mx.random.key(1000 + i)
            layer.update_and_fetch(mx.random.normal((1, H, ctx, D), key=key),
                                   mx.random.normal((1, H, ctx, D), key=mx.random.split(key)[0]))
            if name in DTYPES:  # its sealed 4-bit run is read as floats: scored by the full-precision codecs
                stored[id(layer.memo)] = (layer.codecs, DTYPES[name])
                layer.codecs = layer.full
        mx.eval([x for layer in c for x in layer.state])
    names, tok, last = list(caches), mx.array([[42]]), {}
    t = {n: [] for n in names}
    for it in range(iterations + 3):
        for n in names[it % 4:] + names[: it % 4]:
            t0 = time.perf_counter()
            last[n] = model(tok, cache=caches[n])[:, -1]
            mx.eval(last[n])
            dt = time.perf_counter() - t0
            for layer in caches[n]:
                layer.trim(1)  # (the open page never seals here, so the swapped codecs never encode)
            if it >= 3:
                t[n].append(dt)
    base = t["mlx-lm-fp16"]
    memo = {n: sum(layer.memo.nbytes for layer in caches[n]) / 2**20 for n in names[1:]}
    print(f"ctx {ctx}: " + " ".join(f"{n}={statistics.median(b / x for b, x in zip(base, t[n])):.3f}x "
                                     f"({statistics.median(t[n]) * 1e3:.1f} ms)" for n in names)
          + " memo MB " + " ".join(f"{n}={m:.0f}" for n, m in memo.items())
          + " max|dlogit| vs q4: " + " ".join(f"{n}={float(mx.abs(last[n] - last['q4']).max()):.2g}" for n in DTYPES),
          flush=True)
