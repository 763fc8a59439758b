"""The stored-responses files (RESPONSES_STORE.md): round trip, ids that are no path, format version,
30-day expiry, the 1,000-record cap and delete; no model needed."""

import json
import os
import time

import pytest

from justfit.server import response_store
from justfit.server.response_store import ResponseStore, new_id


def record(rid=None, age=0.0):
    rid = rid or new_id()
    return {"id": rid, "created_at": int(time.time() - age), "session": rid, "retention": "24h",
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
            "response": {"id": rid, "object": "response"}}


def test_round_trip_leaves_no_temp_file(tmp_path):
    store = ResponseStore(tmp_path / "responses")
    r = record()
    store.save(r)
    assert store.load(r["id"]) == {"version": 1, **r}
    assert [p.name for p in (tmp_path / "responses").iterdir()] == [f"{r['id']}.json"]


@pytest.mark.parametrize("rid", ["../x", "resp_../../etc/passwd", "resp_" + "g" * 32, "resp_" + "a" * 31, "", None])
def test_an_id_that_is_no_response_id_is_unknown(tmp_path, rid):
    store = ResponseStore(tmp_path)
    assert store.load(rid) is None and store.delete(rid) is False


def test_other_version_and_unreadable_files_are_unknown(tmp_path):
    store = ResponseStore(tmp_path)
    r = record()
    store.save(r)
    path = tmp_path / f"{r['id']}.json"
    path.write_text(json.dumps({**r, "version": 2}))
    assert store.load(r["id"]) is None
    path.write_text("{not json")
    assert store.load(r["id"]) is None and path.exists()


def test_expired_record_is_removed_when_read(tmp_path):
    store = ResponseStore(tmp_path)
    old, fresh = record(age=31 * 86400), record(age=29 * 86400)
    store.save(old)
    store.save(fresh)
    assert store.load(old["id"]) is None and not (tmp_path / f"{old['id']}.json").exists()
    assert store.load(fresh["id"])["id"] == fresh["id"]


def test_cap_removes_the_oldest(tmp_path, monkeypatch):
    monkeypatch.setattr(response_store, "MAX_STORED", 3)
    store = ResponseStore(tmp_path)
    ids = []
    for i in range(5):
        r = record()
        store.save(r)
        os.utime(tmp_path / f"{r['id']}.json", (1000 + i, 1000 + i))  # written in this order
        ids.append(r["id"])
    store.save(record())
    left = {p.stem for p in tmp_path.glob("resp_*.json")}
    assert len(left) == 3 and not left & set(ids[:3])


def test_delete(tmp_path):
    store = ResponseStore(tmp_path)
    r = record()
    store.save(r)
    assert store.delete(r["id"]) is True and store.load(r["id"]) is None and store.delete(r["id"]) is False
