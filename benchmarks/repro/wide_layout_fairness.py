"""Is bench batch's mlx-lm baseline on the --wide model fair after the layout round trip? Three copies of the
wide model (same seed, 2 layers): built by mlx-lm and never touched; row_major then standard (what bench batch
hands mlx-lm); row-major (what JustFit runs). Decode B = 1 at CONTEXT with mlx-lm's KVCache, arms interleaved,
medians (min-max), and each arm's first greedy tokens.
Usage: python benchmarks/repro/wide_layout_fairness.py [ROUNDS] [CONTEXT] [STEPS]
"""

import sys
from pathlib import Path

import justfit  # noqa: F401  (OpenBLAS before MLX)
import mlx.core as mx

from justfit.bench.batch import wide_model
from justfit.bench.stats import spread
from justfit.models import layout

sys.path.insert(0, str(Path(__file__).resolve().parent))
from row_major_ab import decode, filled  # noqa: E402  (the layout A/B's own fill and decode loops)

ROUNDS, CTX, STEPS = ([int(a) for a in sys.argv[1:]] + [5, 512, 8][len(sys.argv) - 1:])[:3]


def build(*switches):
    model = wide_model(2, 49152)
    mx.eval(model.parameters())
    for switch in switches:
        switch(model)
    return model


def main():
    arms = {"untouched": build(), "round-trip": build(layout.row_major, layout.standard),
            "row-major": build(layout.row_major)}
    caches = {k: filled(m, 1, CTX) for k, m in arms.items()}
    times, tokens = {k: [] for k in arms}, {}
    for r in range(ROUNDS):
        for k in list(arms) if r % 2 == 0 else list(arms)[::-1]:
            t, tokens[k] = decode(arms[k], caches[k], STEPS, 1)
            times[k].append(t)
    for k, v in times.items():
        print(k, {a: round(b, 3) for a, b in spread("tok_s", v).items()}, tokens[k][:4], flush=True)


if __name__ == "__main__":
    main()
