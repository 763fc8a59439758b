"""Regime detection: label each decode budget of a latency sweep normal or anomalous.

Method (one series = one context and one KV setting, latencies of `repeats` runs per budget):

1. Per budget, the median of the repeats is the level; its standard error, from 1.4826 * MAD of
   the log-latencies over sqrt(repeats), is the repeat noise. Medians make one run hit by another process on a shared machine harmless.
2. The normal curve is a smooth function of the budget (about linear with a KV cache, about
   quadratic without). It is fitted in log space, log latency ~ quadratic in log budget, with a
   trimmed least-squares loop: fit, centre the residuals on their median, measure their spread
   with the MAD, drop the budgets more than `trim` spreads above the fit, refit until the set of
   kept budgets stops changing. Anomalies are slowdowns, so only upward outliers are dropped; the
   fit survives anomalous intervals covering up to about half the grid.
3. A budget is anomalous when its level stands above that baseline by more than `z` noise units
   (the larger of the fit spread, the repeat noise of that budget and a floor `min_noise`) and by a
   practically meaningful factor (ratio >= `min_ratio`), and most of its repeats agree (at least
   `quorum` of them are above baseline * `min_ratio`), so one slow run never makes a regime.
4. A budget whose level exceeds both neighbours by `min_ratio` and more than `z` repeat-noise units
   is also anomalous (a local change point both ways); this catches narrow spikes on a curve the
   global fit follows poorly.
5. Consecutive budgets with the same label form an interval. An anomalous interval reports its
   onset (first anomalous budget), recovery (first normal budget after it, None if the grid ends
   first), peak budget and spike ratio (peak level / baseline there). The KV speedup of a budget
   is median latency without cache / median latency with cache at the same context.

Series of fewer than three budgets have no neighbours to compare with: nothing is flagged there.
"""

from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np

MAD_SCALE = 1.4826


@dataclass(frozen=True)
class DetectorParams:
    """Thresholds of the detector; the defaults suit 3-10 repeats on a noisy shared machine."""

    z: float = 4.0
    min_ratio: float = 1.5
    min_noise: float = 0.03
    trim: float = 3.0
    quorum: float = 0.6
    degree: int = 2


@dataclass
class BudgetLabel:
    """The detector's verdict for one budget of one series."""

    budget: int
    median_s: float
    baseline_s: float
    ratio: float
    z: float
    anomalous: bool


@dataclass
class Interval:
    """A run of budgets with one label; onset/recovery/spike_ratio only for anomalous intervals."""

    label: str
    start: int
    end: int
    onset: Optional[int] = None
    recovery: Optional[int] = None
    peak_budget: Optional[int] = None
    spike_ratio: Optional[float] = None


def _mad(x: np.ndarray) -> float:
    """Scaled median absolute deviation: a robust standard deviation."""
    return float(MAD_SCALE * np.median(np.abs(x - np.median(x)))) if x.size else 0.0


def local_noise(log_levels: np.ndarray) -> float:
    """Noise of the levels from second differences: anomalous intervals touch few of them."""
    if log_levels.size < 3:
        return 0.0
    second = log_levels[1:-1] - (log_levels[:-2] + log_levels[2:]) / 2
    return _mad(second) / np.sqrt(1.5)


def robust_baseline(budgets: np.ndarray, log_levels: np.ndarray, params: DetectorParams):
    """(fitted log-levels, residual spread) of the trimmed polynomial fit; see the module docstring."""
    x = np.log(budgets.astype(float))
    x = (x - x.mean()) / (x.std() or 1.0)
    degree = min(params.degree, (len(x) - 1) // 3)  # at least three budgets per coefficient
    sigma = max(local_noise(log_levels), params.min_noise / 2)

    def fit_on(keep):
        return np.polyval(np.polyfit(x[keep], log_levels[keep], degree), x)

    fit = fit_on(np.ones(len(x), dtype=bool))
    resid = log_levels - fit
    keep = resid <= np.median(resid)  # start from the lower half: anomalies only ever slow down
    if keep.sum() <= degree + 1:
        keep[:] = True
    for _ in range(50):
        fit = fit_on(keep)
        resid = log_levels - fit
        new_keep = resid <= params.trim * max(sigma, _mad(resid[keep]))
        if new_keep.sum() <= degree or np.array_equal(new_keep, keep):
            break
        keep = new_keep
    return fit, max(_mad(resid[keep]), sigma)


def label_series(budgets: Sequence[int], repeats: Sequence[Sequence[float]],
                 params: DetectorParams = DetectorParams()) -> List[BudgetLabel]:
    """Label every budget of one series; `repeats[i]` are the measured latencies at budgets[i]."""
    order = np.argsort(budgets)
    b = np.asarray(budgets)[order]
    runs = [np.log(np.maximum(np.asarray(repeats[i], dtype=float), 1e-12)) for i in order]
    levels = np.array([np.median(r) for r in runs])
    noise = np.array([1.2533 * _mad(r) / np.sqrt(len(r)) for r in runs])  # std error of a median
    if len(b) < 3:
        return [BudgetLabel(int(bi), float(np.exp(lv)), float(np.exp(lv)), 1.0, 0.0, False) for bi, lv in zip(b, levels)]
    fit, spread = robust_baseline(b, levels, params)
    level_noise = local_noise(levels)
    log_ratio = np.log(params.min_ratio)
    out = []
    for i, bi in enumerate(b):
        scale = max(spread, noise[i], params.min_noise)
        excess = levels[i] - fit[i]
        z = excess / scale
        agree = np.mean(runs[i] - fit[i] >= log_ratio) >= params.quorum
        glob = z > params.z and excess >= log_ratio and agree
        out.append(BudgetLabel(int(bi), float(np.exp(levels[i])), float(np.exp(fit[i])),
                               float(np.exp(excess)), float(z), bool(glob)))
    for i in range(1, len(b) - 1):  # local spikes: above both neighbours
        local = max(noise[i - 1], noise[i], noise[i + 1], level_noise, params.min_noise)
        top = max(levels[i - 1], levels[i + 1])
        rise = levels[i] - top
        agree = np.mean(runs[i] - top >= log_ratio) >= params.quorum
        if rise >= log_ratio and rise / local > params.z and agree:
            out[i].anomalous = True
    return out


def intervals(labels: Sequence[BudgetLabel]) -> List[Interval]:
    """Group consecutive budgets with one label; anomalous ones get onset, recovery and peak."""
    out: List[Interval] = []
    for i, lab in enumerate(labels):
        name = "anomalous" if lab.anomalous else "normal"
        if out and out[-1].label == name:
            out[-1].end = lab.budget
        else:
            out.append(Interval(name, lab.budget, lab.budget))
        if lab.anomalous:
            cur = out[-1]
            cur.onset = cur.start
            if cur.spike_ratio is None or lab.ratio > cur.spike_ratio:
                cur.peak_budget, cur.spike_ratio = lab.budget, lab.ratio
            nxt = labels[i + 1] if i + 1 < len(labels) else None
            cur.recovery = nxt.budget if nxt is not None and not nxt.anomalous else None
    return out


def kv_speedup(on: Dict[int, float], off: Dict[int, float]) -> Dict[int, float]:
    """Median latency without a cache over median latency with one, per budget present in both."""
    return {b: off[b] / on[b] for b in sorted(set(on) & set(off)) if on[b] > 0}


def detect(series: Dict[tuple, Dict[int, List[float]]], params: DetectorParams = DetectorParams()) -> dict:
    """Labels and intervals for every series {(context, kv): {budget: [latencies]}}."""
    labels, regimes = {}, []
    for (context, kv), by_budget in sorted(series.items()):
        budgets = sorted(by_budget)
        labs = label_series(budgets, [by_budget[b] for b in budgets], params)
        labels[(context, kv)] = labs
        regimes += [dict(context=context, kv=kv, **asdict(iv)) for iv in intervals(labs)]
    return {"labels": labels, "regimes": regimes, "params": asdict(params)}
