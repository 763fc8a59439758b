"""A/B of the weight layout alone (justfit/models/layout.py): the default model with mlx-lm's own KVCache,
weights row-major (x @ W^T stored [in, out]) vs as mlx_lm.load lays them out (W [out, in]); one model, the
layout switched between arms (outside the timed region), arms interleaved, medians with min-max.

Rows: decode tok/s at a context (B = 1), a batched decode step (B rows, one token each), prefill tok/s
(one chunk), and the greedy tokens of both arms (they must match).
Usage: python benchmarks/repro/row_major_ab.py [ROUNDS] [CONTEXT] [STEPS] [BATCH] [PREFILL]
"""

import sys
import time

import justfit  # OpenBLAS before MLX
import mlx.core as mx
from mlx_lm.models.cache import KVCache

from justfit.bench.stats import spread
from justfit.models import layout

ROUNDS, CTX, STEPS, BATCH, PREFILL = ([int(a) for a in sys.argv[1:]] + [7, 512, 8, 16, 512][len(sys.argv) - 1:])[:5]


def filled(model, rows, ctx):
    caches = [KVCache() for _ in model.layers]
    ids = mx.random.randint(100, 40000, (rows, ctx), key=mx.random.key(ctx + rows))
    for i in range(0, ctx, 512):
        model(ids[:, i:i + 512], cache=caches)
        mx.eval([c.state for c in caches])
    return caches


def decode(model, caches, steps, rows):
    tok = mx.full((rows, 1), 42, dtype=mx.int32)
    out = []
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = mx.argmax(model(tok, cache=caches)[:, -1:], axis=-1)
        mx.eval(tok)
        out.append(tok[0, 0].item())
    dt = time.perf_counter() - t0
    for c in caches:
        c.trim(steps)
    return rows * steps / dt, out


def prefill(model, n):
    caches = [KVCache() for _ in model.layers]
    ids = mx.random.randint(100, 40000, (1, n), key=mx.random.key(7))
    mx.eval(ids)
    t0 = time.perf_counter()
    model(ids, cache=caches)
    mx.eval([c.state for c in caches])
    return n / (time.perf_counter() - t0)


def main():
    model, _ = justfit.load("default")
    print(f"load: {layout.row_major_names(model).__len__()} weights row-major; rounds {ROUNDS}, context {CTX}, "
          f"{STEPS} steps, batch {BATCH}, prefill {PREFILL}", flush=True)
    arms = {"row-major": {}, "mlx-lm layout": {}}
    caches = {}
    for arm in arms:  # caches are layout-independent: filled once per arm, in that arm's layout
        if arm != "row-major":
            layout.standard(model)
        caches[arm] = (filled(model, 1, CTX), filled(model, BATCH, CTX))
        decode(model, caches[arm][0], 2, 1)  # warm-up
        if arm != "row-major":
            layout.row_major(model)
    tokens = {}
    for r in range(ROUNDS):
        for arm in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            if arm != "row-major":
                layout.standard(model)
            single, batch = caches[arm]
            tps, toks = decode(model, single, STEPS, 1)
            tokens.setdefault(arm, toks)
            arms[arm].setdefault("decode_tok_s", []).append(tps)
            arms[arm].setdefault("batch_tok_s", []).append(decode(model, batch, max(2, STEPS // 2), BATCH)[0])
            arms[arm].setdefault("prefill_tok_s", []).append(prefill(model, PREFILL))
            if arm != "row-major":
                layout.row_major(model)
        print(f"round {r + 1}: " + "  ".join(f"{a} {v['decode_tok_s'][-1]:.2f}/{v['batch_tok_s'][-1]:.1f}/"
                                             f"{v['prefill_tok_s'][-1]:.0f}" for a, v in arms.items()), flush=True)
    for key in ("decode_tok_s", "batch_tok_s", "prefill_tok_s"):
        row = {a: spread(key, v[key]) for a, v in arms.items()}
        rm, base = row["row-major"], row["mlx-lm layout"]
        print(f"{key:14s} row-major {rm[key]:8.2f} ({rm[key + '_min']:.2f}-{rm[key + '_max']:.2f})  "
              f"mlx-lm layout {base[key]:8.2f} ({base[key + '_min']:.2f}-{base[key + '_max']:.2f})  "
              f"ratio {rm[key] / base[key]:.3f}")
    print("greedy tokens equal:", tokens["row-major"] == tokens["mlx-lm layout"])


if __name__ == "__main__":
    main()
