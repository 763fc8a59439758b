"""One memory budget: the engine's KV pages and the prefix index's cached pages live under the same KV share
of it (the budget less every weight PhaseSwap holds), not under a figure of their own."""

import justfit


def test_engine_and_prefix_index_share_the_kv_share_of_the_budget(default_model_dir, tmp_path):
    budget = 1 << 30
    rt = justfit.Runtime(model=str(default_model_dir), memory_budget=budget, home=tmp_path)
    weights = sum(c.size() for c in rt.phaseswap.components.values() if c.kind != "kv")
    assert 0 < weights < budget
    assert rt.kv_budget() == budget - weights
    assert rt.index.memory_cap == rt.kv_budget() == rt.batch_engine().budget_bytes
    free = justfit.Runtime(model=str(default_model_dir), home=tmp_path / "no-budget")
    assert free.kv_budget() is None and free.batch_engine().budget_bytes is None
    assert free.index.memory_cap is not None  # without a budget the index keeps its own cap


def test_phaseswap_counts_the_engines_kv_figure_and_reclaims_cold_prefixes_before_evicting_weights(
        default_model_dir, tmp_path):
    budget = 1 << 30
    rt = justfit.Runtime(model=str(default_model_dir), memory_budget=budget, home=tmp_path, drafter="none")
    rt.generate("Tell me about the sea. " * 60, max_tokens=2)  # its pages stay in the pool as a cached prefix
    res = rt.residency()
    kv = rt.batch_engine().kv.used_bytes()
    weights = sum(c["bytes"] for c in res["components"] if c["resident"] and c["kind"] != "kv")
    assert kv > 0 and res["kv_bytes"] == kv and res["resident_bytes"] == weights + kv  # one figure, counted once
    workspace = budget - weights - kv // 2  # fits only once half the cached pages are given back
    rt.phaseswap.enter("prefill", workspace=workspace)
    assert rt.batch_engine().kv.used_bytes() <= kv // 2  # cold cached prefixes went first
    assert not [e for e in rt.phaseswap.evictions if rt.phaseswap.components[e].kind != "kv"]  # no weight evicted
