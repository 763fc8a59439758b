"""The regime detector on synthetic sweeps with planted spikes and plateaus under shared-machine noise."""

import numpy as np
import pytest

from justfit.probe import regimes, synthetic

BUDGETS = np.arange(128, 769, 16)  # the paper's grid


def _labels(series):
    budgets = sorted(series)
    return regimes.label_series(budgets, [series[b] for b in budgets])


def test_precision_and_recall_over_a_generated_suite():
    tp = fp = fn = 0
    for seed in range(120):
        rng = np.random.default_rng(seed)
        series, truth = synthetic.series(rng, BUDGETS, repeats=5, anomalies=int(rng.integers(1, 4)),
                                         kv="on" if seed % 2 else "off")
        pred = np.array([lab.anomalous for lab in _labels(series)])
        tp += int((pred & truth).sum())
        fp += int((pred & ~truth).sum())
        fn += int((~pred & truth).sum())
    precision, recall = tp / (tp + fp), tp / (tp + fn)
    assert precision >= 0.9 and recall >= 0.9, (precision, recall)


@pytest.mark.parametrize("kv", ["on", "off"])
def test_no_false_regimes_on_smooth_noisy_series(kv):
    false = []
    for seed in range(60):
        rng = np.random.default_rng(1000 + seed)
        series, truth = synthetic.series(rng, BUDGETS, repeats=5, anomalies=0, kv=kv)
        assert not truth.any()
        flagged = [lab.budget for lab in _labels(series) if lab.anomalous]
        if flagged:
            false.append((seed, flagged))
    assert not false


def test_smooth_series_with_heavy_uniform_noise_and_one_slow_run_per_budget():
    rng = np.random.default_rng(3)
    base = 0.2 + 0.01 * BUDGETS
    lat = base[:, None] * np.exp(rng.normal(0, 0.12, (len(BUDGETS), 5)))
    lat[np.arange(len(BUDGETS)), rng.integers(0, 5, len(BUDGETS))] *= 3  # one hiccup in every budget
    assert not any(lab.anomalous for lab in regimes.label_series(BUDGETS.tolist(), lat.tolist()))


def test_planted_plateau_gets_onset_recovery_and_spike_ratio():
    rng = np.random.default_rng(11)
    base = 1.0 + 0.02 * BUDGETS
    lat = base[:, None] * np.exp(rng.normal(0, 0.04, (len(BUDGETS), 5)))
    inside = (BUDGETS >= 480) & (BUDGETS <= 560)
    lat[inside] *= 8.0
    ivs = regimes.intervals(regimes.label_series(BUDGETS.tolist(), lat.tolist()))
    bad = [iv for iv in ivs if iv.label == "anomalous"]
    assert len(bad) == 1
    assert (bad[0].onset, bad[0].end, bad[0].recovery) == (480, 560, 576)
    assert 6.5 < bad[0].spike_ratio < 10
    assert [iv.label for iv in ivs] == ["normal", "anomalous", "normal"]
    assert ivs[0].end == 464 and ivs[2].start == 576


def test_anomaly_running_to_the_end_has_no_recovery():
    budgets = list(range(16, 257, 16))
    lat = [[0.1 * b * (6 if b >= 224 else 1) * f for f in (0.98, 1.0, 1.02)] for b in budgets]
    bad = [iv for iv in regimes.intervals(regimes.label_series(budgets, lat)) if iv.label == "anomalous"]
    assert len(bad) == 1 and bad[0].onset == 224 and bad[0].recovery is None


def test_single_slow_repeat_is_not_a_regime_but_a_consistent_spike_is():
    budgets = list(range(16, 257, 16))
    lat = [[0.05 * b * f for f in (0.97, 1.0, 1.03, 0.99, 1.01)] for b in budgets]
    lat[5][2] *= 20  # one run hit by another process
    assert not any(lab.anomalous for lab in regimes.label_series(budgets, lat))
    lat[9] = [x * 3 for x in lat[9]]
    flagged = [lab.budget for lab in regimes.label_series(budgets, lat) if lab.anomalous]
    assert flagged == [budgets[9]]


def test_short_grids_never_crash_and_kv_speedup_is_off_over_on():
    assert not any(lab.anomalous for lab in regimes.label_series([8, 16], [[1.0], [2.0]]))
    assert regimes.kv_speedup({8: 1.0, 16: 2.0}, {8: 3.0, 16: 8.0, 32: 9.0}) == {8: 3.0, 16: 4.0}
    det = regimes.detect({(32, "on"): {b: [0.01 * b] for b in (8, 16, 32, 64)}})
    assert [r["label"] for r in det["regimes"]] == ["normal"] and det["regimes"][0]["end"] == 64
