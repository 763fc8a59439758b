"""Leases, eviction order and budget refusals on synthetic components (no model needed)."""

import pytest

from justfit.errors import MemoryBudgetError, UserError
from justfit.phaseswap import Budget, Component, Residency, parse_budget
from justfit.phaseswap.leases import LeaseError, Leases

MB = 10**6


def comp(name, kind="layers", nbytes=10 * MB, roles=("layers",), depends=(), log=None, checkpointed=False):
    log = log if log is not None else []
    return Component(name, kind, nbytes, lambda: log.append(("load", name)), lambda: log.append(("unload", name)),
                     roles=roles, depends=depends, checkpointed=lambda: checkpointed)


def test_leases_idempotent_dependencies_and_last_release():
    deps = {"adapter": ("layers",), "layers": (), "head": ()}
    freed = []
    leases = Leases(lambda n: deps[n], freed.append)
    assert leases.acquire("a", ["adapter"]) == {"adapter", "layers"}  # dependency comes along
    assert leases.acquire("a", ["adapter"]) == {"adapter", "layers"}  # idempotent
    leases.acquire("b", ["layers", "head"])
    assert leases.holders("layers") == {"a", "b"}
    leases.release("a")
    assert freed == ["adapter"]  # layers still held by b
    leases.release("a")  # releasing twice is a no-op
    assert freed == ["adapter"]
    leases.release("b")
    assert sorted(freed) == ["adapter", "head", "layers"]
    assert not leases.is_held("layers")


def test_lease_cycle_is_refused():
    leases = Leases(lambda n: {"x": ("x",)}[n])
    with pytest.raises(LeaseError):
        leases.acquire("l", ["x"])


def test_phase_leases_and_eviction_order():
    log = []
    r = Residency(Budget(limit=100 * MB, reserve=0))
    r.add(comp("embed", "embedding", roles=("input-embedding", "lm-head"), log=log))
    r.add(comp("layers", log=log))
    r.add(comp("draft", "draft-model", roles=("drafter",), log=log))
    r.add(comp("kv:old", "kv", roles=("kv",), log=log, checkpointed=True))
    r.add(comp("kv:dirty", "kv", roles=("kv",), log=log, checkpointed=False))
    r.enter("decode")
    assert {"embed", "layers", "draft"} <= r.leases.held["phase"]
    r.enter("prefill")  # drafter lease dropped: evictable, but nothing is evicted without pressure
    assert "draft" not in r.leases.held["phase"] and r.components["draft"].resident
    order = [c.name for c in r.victims()]
    assert order == ["kv:old", "draft", "kv:dirty"]  # checkpointed KV, drafter, ..., unsaved KV last
    r.budget.limit = 35 * MB  # 50 MB resident: two evictions needed, in that order
    r.enter("prefill")
    assert [e for e in log if e[0] == "unload"] == [("unload", "kv:old"), ("unload", "draft")]
    assert r.components["embed"].resident and r.components["layers"].resident


def test_tied_embedding_survives_head_release():
    r = Residency(Budget(limit=None, reserve=0))
    r.add(comp("embed", "embedding", roles=("input-embedding", "lm-head")))
    r.add(comp("layers"))
    r.enter("prefill-last")
    r.enter("prefill")  # no lm-head role needed, but the same tensor is the input embedding
    assert "embed" in r.leases.held["phase"]
    assert "embed" not in [c.name for c in r.victims()]


def test_budget_refusal_names_need_and_availability():
    r = Residency(Budget(limit=25 * MB, reserve=0))
    r.add(comp("embed", "embedding", nbytes=20 * MB, roles=("input-embedding", "lm-head")))
    r.add(comp("layers", nbytes=20 * MB))
    for c in r.components.values():
        c.resident = False
    with pytest.raises(MemoryBudgetError) as e:
        r.enter("decode", workspace=1 * MB)
    msg = str(e.value)
    assert "'decode'" in msg and "embed 20.0 MB" in msg and "layers 20.0 MB" in msg
    assert "budget 25.0 MB" in msg and "system available" in msg
    assert not any(c.resident for c in r.components.values())  # nothing was loaded


def test_live_available_memory_check(monkeypatch):
    import justfit.phaseswap.budget as budget

    monkeypatch.setattr(budget, "available_memory", lambda: 30 * MB)
    r = Residency(Budget(limit=None, reserve=10 * MB))
    r.add(comp("layers", nbytes=50 * MB))
    r.components["layers"].resident = False
    with pytest.raises(MemoryBudgetError, match="system available 30.0 MB"):
        r.enter("prefill")


def test_parse_budget():
    assert parse_budget(None) is None
    assert parse_budget(1234) == 1234
    assert parse_budget("512MiB") == 512 * 2**20
    assert parse_budget("2GB") == 2 * 10**9
    half = parse_budget(0.5)
    assert half == parse_budget("50%") and half > 0
    for bad in (0, -5, 1.5, "lots", True):
        with pytest.raises(UserError):
            parse_budget(bad)
