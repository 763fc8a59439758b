"""Two levers for single-query decode at 1-2k tokens, A/B against kvexec/decode.py's memo path:
`split`: the sealed 4-bit run cut in two, scored and mixed on two CPU streams (streams.py) under one softmax;
`widen`: the float run (first page + window copy, 16-bit) widened to float32 once in the memo instead of every
step; `both`. One cache per variant, filled alike; medians of 11 interleaved rounds over 30 layers, in ms.
(session 15: 1k memo 26.5, split 25.0, widen 25.2, both 27.7, sdpa 20.1; 2k memo 43.4, split 41.4, widen 44.7,
both 41.7, sdpa 36.5; a second run at 2k: memo 55.7, split 47.9, widen 54.5, both 47.1, sdpa 44.6. min-max spans
10-35 ms; the split gained 4% and 14%. Session 16 landed the split in decode.py, so `memo` here now splits too:
decode_split_ab.py compares it with one stream. `widen` at 512 in session 16: memo 15.6, widen 14.8, sdpa 12.7)

Run: python docs/bench/repro/decode_levers_2k.py 1024,2048
"""
import statistics
import sys
import time

import justfit  # noqa: F401,I001  (before mlx: justfit loads OpenBLAS)
import mlx.core as mx

from justfit.kvexec import decode, streams
from justfit.kvexec.formats import concat_parts
from justfit.kvexec.pages import FULL, OPEN, QUANT


def _run(cache, key, pages, codecs, widen):
    """(key parts, value parts) of `pages` stacked once in the cache's memo under `key`."""
    held = cache.memo.runs.get(key)
    if held is None or len(held[0]) != len(pages) or any(a is not b for a, b in zip(pages, held[0])):
        parts = tuple(concat_parts([p.parts()[w] for p in pages]) for w in (0, 1))
        if key != FULL or widen:
            parts = tuple(codec.widened(x, mx.float32) for codec, x in zip(codecs, parts))
        held = cache.memo.runs[key] = (tuple(pages), parts)
    return held[1]


def attention(queries, cache, scale, split=True, widen=True):
    """decode.attention with the levers: the 4-bit run split across streams, the float run widened once."""
    _, Hq, _, D = queries.shape
    H = cache.n_kv_heads
    quant, sealed, open_ = [], [], None
    for _, n, page in cache.attended_pages():
        if page.kind == OPEN:
            open_ = (n, page)
        else:
            (quant if page.kind == QUANT else sealed).append(page)
    q = queries.reshape(H, Hq // H, D).astype(mx.float32) * scale
    n_parts = streams.parts(Hq * len(quant) * cache.seq.page_size) if split else 1
    groups = streams.balanced(quant, [1] * len(quant), n_parts) if quant else []
    runs = [(i, (QUANT, i), g, cache.codecs) for i, g in enumerate(groups)]
    if sealed:
        runs.append((0, FULL, sealed, cache.full))
    scores, values = [], []
    for i, key, pages, (ck, cv) in runs:
        kparts, vparts = _run(cache, key, pages, (ck, cv), widen)
        with streams.on(i):
            scores.append(ck.scores(ck.prepare(q), kparts).astype(mx.float32))
        values.append((i, cv, vparts))
    if open_ is not None:
        n, page = open_
        fk, fv = cache.full
        k, v = (x[0][:, :n].astype(mx.float32) for x in page.parts())
        scores.append(fk.scores(q, (k,)))
        values.append((0, fv, (v,)))
    p = mx.softmax(mx.concatenate(scores, axis=-1), axis=-1, precise=True)
    o, t0 = None, 0
    for s, (i, cv, parts) in zip(scores, values):
        T = s.shape[-1]
        with streams.on(i):
            x = cv.finish(cv.mix(p[..., t0 : t0 + T], parts))
        o, t0 = x if o is None else o + x, t0 + T
    return o.reshape(1, Hq, 1, -1).astype(queries.dtype)


model, _ = justfit.load("default")
L, attn = len(model.layers), model.layers[0].self_attn
H, D, Hq = attn.n_kv_heads, attn.head_dim, attn.n_heads
for ctx in [int(x) for x in sys.argv[1].split(",")]:
    k = mx.random.normal((1, H, ctx, D), key=mx.random.key(1))
    v = mx.random.normal((1, H, ctx, D), key=mx.random.key(2))
    new = mx.random.normal((1, H, 1, D), key=mx.random.key(3))
    caches = []
    for _ in range(4):
        c = justfit.make_cache(model, justfit.KVConfig())
        for layer in c:
            layer.update_and_fetch(k, v)
            layer.update_and_fetch(new, new)
            layer.settle_window()
        mx.eval([x for layer in c for x in layer.state])
        caches.append(c)
    q = mx.random.normal((1, Hq, 1, D))
    kf, vf = mx.concatenate([k, new], 2), mx.concatenate([v, new], 2)
    mx.eval(kf, vf)
    fs = {
        "memo": lambda: [decode.attention(q, caches[0][i], 0.125) for i in range(L)],
        "split": lambda: [attention(q, caches[1][i], 0.125, widen=False) for i in range(L)],
        "widen": lambda: [attention(q, caches[2][i], 0.125, split=False) for i in range(L)],
        "both": lambda: [attention(q, caches[3][i], 0.125) for i in range(L)],
        "sdpa": lambda: [mx.fast.scaled_dot_product_attention(q, kf, vf, scale=0.125) for _ in range(L)],
    }
    ref = fs["memo"]()[0]
    print(ctx, "max |diff| vs memo:", {n: float(mx.abs(f()[0] - ref).max()) for n, f in fs.items() if n != "sdpa"})
    t = {n: [] for n in fs}
    for _ in range(11):
        for n, f in fs.items():
            mx.eval(f())
            t0 = time.perf_counter()
            mx.eval(f())
            t[n].append((time.perf_counter() - t0) * 1e3)
    print(ctx, "  ".join(f"{n} {statistics.median(x):.1f} ({min(x):.1f}-{max(x):.1f})" for n, x in t.items()), flush=True)
