"""StateTrans across ranks: a session checkpointed by 2 ranks restores on 2 ranks (its pages are
reused, one world manifest names both ranks' pages) and is refused on 1 rank with a one-line reason."""

import json

import pytest
from distributed_launch import WORKER, last_json, launch, why_not

from justfit.distributed.sessions import check_world, read_world_manifest, world_manifest_path
from justfit.distributed.shard import Sharding
from justfit.errors import UserError


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from statetrans_util import tiny_model_folder

    return tiny_model_folder(tmp_path_factory.mktemp("tiny-dist"), layers=4)


def test_two_ranks_checkpoint_restore_on_two_refuse_on_one(tiny_folder, tmp_path):
    reason = why_not()
    if reason:
        pytest.skip(reason)
    home = tmp_path / "home"
    first = last_json(launch(2, [WORKER, "session", tiny_folder, home, 16, 6, "hello there my friend", "s1"], timeout=240))
    doc = read_world_manifest(home, "s1")
    assert doc["world_size"] == 2 and doc["sharding"] == "tensor"
    assert [r["session"] for r in doc["ranks"]] == ["s1.tp2r0", "s1.tp2r1"]
    assert all(r["pages"] for r in doc["ranks"]), "each rank checkpointed its own pages"
    assert set(doc["ranks"][0]["pages"]).isdisjoint(doc["ranks"][1]["pages"])  # different shards, different pages

    again = last_json(launch(2, [WORKER, "session", tiny_folder, home, 16, 6, "and once more", "s1"], timeout=240))
    assert again["reused_tokens"] >= 32 and again["history"] > first["history"]

    one = launch(1, [WORKER, "session", tiny_folder, home, 16, 6, "and once more", "s1"], timeout=120)
    assert one.returncode != 0
    assert "was checkpointed by 2 ranks (tensor parallel); this run has 1" in one.stderr


def _sharding(kind, n):
    return Sharding(kind, 0, n)


def test_world_manifest_checks(tmp_path):
    from justfit.distributed.sessions import write_world_manifest

    assert check_world(tmp_path, "fresh", _sharding("tensor", 2)) is None
    write_world_manifest(tmp_path, "s", _sharding("tensor", 2), [{"rank": 0, "pages": []}, {"rank": 1, "pages": []}])
    assert check_world(tmp_path, "s", _sharding("tensor", 2))["world_size"] == 2
    with pytest.raises(UserError, match="checkpointed by 2 ranks .* this run has 4"):
        check_world(tmp_path, "s", _sharding("tensor", 4))
    with pytest.raises(UserError, match="JUSTFIT_SHARDING=tensor"):
        check_world(tmp_path, "s", _sharding("pipeline", 2))
    path = world_manifest_path(tmp_path, "s")
    doc = json.loads(path.read_text())
    doc["world_size"] = 1  # an edit without a new checksum is damage
    path.write_text(json.dumps(doc))
    with pytest.raises(UserError, match="damaged"):
        check_world(tmp_path, "s", _sharding("tensor", 2))
