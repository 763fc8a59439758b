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
