"""Regime maps: saved per key under $JUSTFIT_HOME/probe/, and steering around anomalous intervals."""

import json

from justfit.probe import maps, report
from justfit.probe.synthetic import demo_report as synthetic_report


def test_save_list_and_load_by_key(tmp_path):
    rep = synthetic_report(plateau=(480, 560, 6.0))
    path = maps.save_map(rep, tmp_path)
    assert path.parent == tmp_path / "probe" and path.name.startswith("cpu-test-cpu__synthetic__synthetic-model__fp16__")
    key = maps.key_of(rep)
    assert maps.list_maps(tmp_path) == [(path, key)]
    assert maps.load_map(key, tmp_path)["summary"] == json.loads(json.dumps(rep["summary"]))
    other = maps.MapKey(key.device, key.backend, key.model, "q4-affine")
    assert maps.load_map(other, tmp_path) is None and maps.map_path(other, tmp_path) != path


def test_synthetic_map_makes_steering_pick_a_different_budget_and_say_so(tmp_path):
    rep = synthetic_report(plateau=(480, 560, 6.0))
    key = maps.key_of(maps.save_map(rep, tmp_path) and rep)
    reserved, note = maps.steer_budget(tmp_path, key, context_tokens=40, budget=500)
    assert reserved == 576
    assert "480-560" in note and "reserved 576, stopping at 500" in note
    # the budget where the interval starts, and a request on the longer context, are steered too
    assert maps.steer_budget(tmp_path, key, 30, 480)[0] == 576
    assert maps.steer_budget(tmp_path, key, 600, 560)[0] == 576
    # outside the interval, or without a map, nothing changes and nothing is said
    assert maps.steer_budget(tmp_path, key, 40, 464) == (464, None)
    assert maps.steer_budget(tmp_path, key, 40, 576) == (576, None)
    assert maps.steer_budget(tmp_path / "empty", key, 40, 500) == (500, None)
    # KV-off series are smooth in this map
    assert maps.steer_budget(tmp_path, key, 40, 500, kv="off") == (500, None)


def test_interval_without_recovery_keeps_the_budget_and_explains(tmp_path):
    rep = synthetic_report(plateau=(704, 768, 6.0))
    maps.save_map(rep, tmp_path)
    reserved, note = maps.steer_budget(tmp_path, maps.key_of(rep), 32, 720)
    assert reserved == 720 and "no normal budget above" in note


def test_corrupt_map_never_fails_a_generation(tmp_path):
    rep = synthetic_report(budgets=range(16, 129, 16))
    path = maps.save_map(rep, tmp_path)
    path.write_text('{"format": "justfit-probe", "version": 1')  # torn write
    reserved, note = maps.steer_budget(tmp_path, maps.key_of(rep), 32, 64)
    assert reserved == 64 and note.startswith("probe map ignored:")
    assert maps.list_maps(tmp_path) == []
    assert report.validate({"format": "other"}) is not None


def test_map_saved_for_a_runtimes_key_steers_that_runtime(runtime16, tmp_path):
    from types import SimpleNamespace

    from justfit.probe.backends import mlx_device

    rep = synthetic_report(plateau=(480, 560, 6.0))
    rep.update(device=mlx_device(), backend="mlx", model=runtime16.model_spec, kv_config=runtime16.kv.name)
    maps.save_map(rep, tmp_path)
    rt = SimpleNamespace(home=tmp_path, model_spec=runtime16.model_spec, kv=runtime16.kv)  # the map's home
    assert maps.runtime_key(rt) == maps.key_of(rep)
    reserved, note = maps.steer_runtime(rt, 40, 500)
    assert reserved == 576 and "stopping at 500" in note
    other = SimpleNamespace(home=tmp_path, model_spec=runtime16.model_spec, kv=type(runtime16.kv)(bits=4))
    assert maps.steer_runtime(other, 40, 500) == (500, None)  # another KV config has no map


def test_runtime_with_steering_reserves_a_steered_budget_and_stops_at_the_users_limit(runtime16, default_model_dir):
    import justfit
    from justfit.probe.backends import mlx_device

    rep = synthetic_report(budgets=range(2, 33, 2), plateau=(6, 12, 6.0))
    rep.update(device=mlx_device(), backend="mlx", model=runtime16.model_spec, kv_config=runtime16.kv.name)
    path = maps.save_map(rep, runtime16.home)
    try:
        policy = maps.RegimeSteering(runtime16.model_spec, runtime16.kv, home=runtime16.home)
        steered = justfit.Runtime(model=runtime16.model_spec, kv=runtime16.kv, home=runtime16.home,
                                  steering=policy)
        g = steered.generate("Count from one to fifty in words.", max_tokens=8)
        ref = runtime16.generate("Count from one to fifty in words.", max_tokens=8)
    finally:
        path.unlink()
    assert g.stats.requested_max_tokens == 8 and g.stats.reserved_max_tokens > 8
    assert g.stats.steer_note
    assert len(g.tokens) <= 8 and g.tokens == ref.tokens
