"""decode.attention (kvexec/decode.py, the memo path) over 30 layers: the 4-bit run split across 2 CPU streams (the
default) vs one stream (streams.MAX_PARTS = 1), and mlx-lm's SDPA on float32 K/V; medians of interleaved rounds, ms.
At 1280 tokens the run is one part either way, so that row runs the same code twice: its gap is the machine's noise.

Run: python benchmarks/repro/decode_split_ab.py 1280,2048,2560 15
"""
import statistics
import sys
import time

import justfit
import mlx.core as mx
from justfit.kvexec import decode, streams


def filled_caches(model, k, v, new, n: int):
    """n caches of the default KVConfig, each layer holding k/v then one more token, window settled."""
    out = []
    for _ in range(n):
        c = justfit.make_cache(model, justfit.KVConfig())
        for layer in c:
            layer.update_and_fetch(k, v)
            layer.update_and_fetch(new, new)
            layer.settle_window()
        mx.eval([x for layer in c for x in layer.state])
        out.append(c)
    return out


def run(q, caches, parts: int, layers: int):
    streams.MAX_PARTS = parts
    return [decode.attention(q, caches[i], 0.125) for i in range(layers)]


def main():
    model, _ = justfit.load("default")
    L, attn = len(model.layers), model.layers[0].self_attn
    H, D, Hq = attn.n_kv_heads, attn.head_dim, attn.n_heads
    rounds = int(sys.argv[2])
    for ctx in [int(x) for x in sys.argv[1].split(",")]:
        k = mx.random.normal((1, H, ctx, D), key=mx.random.key(1))
        v = mx.random.normal((1, H, ctx, D), key=mx.random.key(2))
        new = mx.random.normal((1, H, 1, D), key=mx.random.key(3))
        split, one = filled_caches(model, k, v, new, 2)
        q = mx.random.normal((1, Hq, 1, D))
        kf, vf = mx.concatenate([k, new], 2), mx.concatenate([v, new], 2)
        mx.eval(kf, vf)
        fs = {"split": lambda q=q, c=split: run(q, c, 2, L), "one": lambda q=q, c=one: run(q, c, 1, L),
              "sdpa": lambda q=q, kf=kf, vf=vf: [mx.fast.scaled_dot_product_attention(q, kf, vf, scale=0.125)
                                                 for _ in range(L)]}
        diff = float(mx.abs(fs["split"]()[0] - fs["one"]()[0]).max())
        print(ctx, "max|split-one|", diff, "memo keys", list(split[0].memo.runs))
        t = {n: [] for n in fs}
        for r in range(rounds):
            for n in list(fs)[r % 3:] + list(fs)[: r % 3]:
                mx.eval(fs[n]())
                t0 = time.perf_counter()
                mx.eval(fs[n]())
                t[n].append((time.perf_counter() - t0) * 1e3)
        print(ctx, "  ".join(f"{n} {statistics.median(x):.1f} ({min(x):.1f}-{max(x):.1f})" for n, x in t.items()), flush=True)


if __name__ == "__main__":
    main()
