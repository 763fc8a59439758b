"""Is bench batch's mlx-lm baseline on the --wide model fair after the layout round trip? Three copies of the
wide model (same seed, 2 layers): built by mlx-lm and never touched; row_major then standard (what bench batch
hands mlx-lm); row-major (what JustFit runs). Decode B = 1 at CONTEXT with mlx-lm's KVCache, arms interleaved,
medians (min-max), and each arm's first greedy tokens.
Usage: python docs/bench/repro/wide_layout_fairness.py [ROUNDS] [CONTEXT] [STEPS]
"""

import sys
import time

import justfit  # noqa: F401  (OpenBLAS before MLX)
import mlx.core as mx
from mlx_lm.models.cache import KVCache

from justfit.bench.batch import wide_model
from justfit.bench.stats import spread
from justfit.models import layout

ROUNDS, CTX, STEPS = ([int(a) for a in sys.argv[1:]] + [5, 512, 8][len(sys.argv) - 1:])[:3]


def filled(model, ctx):
    caches = [KVCache() for _ in model.layers]
    model(mx.random.randint(100, 40000, (1, ctx), key=mx.random.key(ctx)), cache=caches)
    mx.eval([c.state for c in caches])
    return caches


def decode(model, caches):
    tok, out = mx.full((1, 1), 42, dtype=mx.int32), []
    t0 = time.perf_counter()
    for _ in range(STEPS):
        tok = mx.argmax(model(tok, cache=caches)[:, -1:], axis=-1)
        out.append(tok.item())
    dt = time.perf_counter() - t0
    for c in caches:
        c.trim(STEPS)
    return STEPS / dt, out


def build(*switches):
    model = wide_model(2, 49152)
    mx.eval(model.parameters())
    for switch in switches:
        switch(model)
    return model


def main():
    arms = {"untouched": build(), "round-trip": build(layout.row_major, layout.standard),
            "row-major": build(layout.row_major)}
    caches = {k: filled(m, CTX) for k, m in arms.items()}
    times, tokens = {k: [] for k in arms}, {}
    for r in range(ROUNDS):
        for k in list(arms) if r % 2 == 0 else list(arms)[::-1]:
            t, tokens[k] = decode(arms[k], caches[k])
            times[k].append(t)
    for k, v in times.items():
        print(k, {a: round(b, 3) for a, b in spread("tok_s", v).items()}, tokens[k][:4], flush=True)


if __name__ == "__main__":
    main()
