"""Synthetic latency sweeps with planted regimes, for testing the detector and drawing demos.

Noise is shaped like a shared machine: per-run log-normal jitter, a per-budget drift that moves
all repeats of one budget together (load changed while it ran), and rare hiccups (a run 1.5-3x
slower; at most a minority of one budget's runs, else the budget really was slow). Anomalies are spikes (one budget) or plateaus (several), each run inside drawn around
the interval's ratio with a wide spread, as the paper saw near thresholds.
"""

from typing import Dict, List, Optional, Tuple

import numpy as np


def smooth_curve(budgets: np.ndarray, rng, kv: str = "on") -> np.ndarray:
    """A normal latency curve: affine in the budget with a cache, plus a quadratic term without."""
    a, b = rng.uniform(0.05, 0.5), rng.uniform(0.005, 0.05)
    lat = a + b * budgets
    if kv == "off":
        lat = lat + rng.uniform(2, 8) * b * budgets**2 / budgets.max()
    return lat


def plant(n: int, rng, count: int, max_width: int = 12, max_share: float = 0.35) -> List[Tuple[int, int, float]]:
    """Up to `count` non-touching (start, stop, ratio) intervals of budget indices, ratio 1.5-21,
    covering at most `max_share` of the grid (normal budgets stay the majority, as measured)."""
    out, taken = [], np.zeros(n, dtype=bool)
    for _ in range(count * 10):
        if len(out) == count:
            break
        width = 1 if rng.random() < 0.4 else int(rng.integers(2, max_width + 1))
        start = int(rng.integers(1, max(n - width, 2)))
        stop = min(start + width, n)
        if taken[max(start - 1, 0):stop + 1].any() or taken.sum() + stop - start > max_share * n:
            continue
        taken[start:stop] = True
        out.append((start, stop, float(np.exp(rng.uniform(np.log(1.5), np.log(21))))))
    return out


def series(rng, budgets: np.ndarray, repeats: int = 5, anomalies: int = 2, kv: str = "on",
           noise: Optional[float] = None) -> Tuple[Dict[int, List[float]], np.ndarray]:
    """({budget: latencies}, truth mask of anomalous budgets) for one synthetic series."""
    base = smooth_curve(budgets, rng, kv)
    sigma = noise if noise is not None else rng.uniform(0.02, 0.10)
    truth = np.zeros(len(budgets), dtype=bool)
    factor = np.ones((len(budgets), repeats))
    for start, stop, ratio in plant(len(budgets), rng, anomalies):
        truth[start:stop] = True
        factor[start:stop] = ratio * np.exp(rng.normal(0, 0.15, (stop - start, repeats)))
    drift = np.exp(rng.normal(0, sigma / 2, (len(budgets), 1)))
    jitter = np.exp(rng.normal(0, sigma, (len(budgets), repeats)))
    hit = rng.random((len(budgets), repeats)) < 0.05
    hit &= np.cumsum(hit, axis=1) <= (repeats - 1) // 2  # a minority: a majority of slow runs is a slow budget
    hiccup = np.where(hit, rng.uniform(1.5, 3, (len(budgets), repeats)), 1)
    lat = base[:, None] * factor * drift * jitter * hiccup
    return {int(b): lat[i].tolist() for i, b in enumerate(budgets)}, truth


class SyntheticBackend:
    """Stands in for a backend when a report is built from synthetic records."""

    name, model_id, kv_name = "synthetic", "synthetic-model", "fp16"
    device = {"kind": "cpu", "name": "test cpu", "platform": "synthetic"}

    def versions(self) -> dict:
        return {}


def demo_report(seed: int = 7, contexts=(32, 512), budgets=range(128, 769, 16), plateau=None) -> dict:
    """A probe report from smooth synthetic series (3% noise, KV off clearly slower), with an
    optional plateau (lo, hi, factor) planted in every KV-on series."""
    from .report import build_report

    rng = np.random.default_rng(seed)
    b = np.asarray(list(budgets))
    records = []
    for ctx in contexts:
        for kv in ("on", "off"):
            lat_by_budget, _ = series(rng, b, repeats=5, anomalies=0, kv=kv, noise=0.03)
            for bb, lat in lat_by_budget.items():
                if kv == "off":
                    lat = [x * (1 + bb / 64) for x in lat]
                if plateau and kv == "on" and plateau[0] <= bb <= plateau[1]:
                    lat = [x * plateau[2] for x in lat]
                records.append(dict(context=ctx, kv=kv, budget=bb, warmup_s=[], e2e_s=lat,
                                    prefill_s=[0.1], step_s=[[0.01] * (bb - 1)]))
    grid = {"contexts": list(contexts), "kv": ["on", "off"], "warmup": 0, "repeats": 5, "step_runs": 1, "seed": seed}
    return build_report(SyntheticBackend(), records, grid)
