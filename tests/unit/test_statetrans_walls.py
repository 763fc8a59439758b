"""The session store's walls (no model): a manifest copied from another session or rolled back to an
older commit is refused, a wrong file at a page's path is replaced, a deleted lock file does not let a
second writer in, and a disk quota evicts the least recently used unpinned sessions."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from justfit.cli import app
from justfit.errors import UserError
from justfit.statetrans.lock import SessionInUse, acquire, lock_path, release
from justfit.statetrans.manifest import Manifest, commit_counter, list_manifests, manifest_path, read_manifest, write_manifest
from justfit.statetrans.store import PageStore, decode_header

ROOT = Path(__file__).resolve().parents[2]
KV = {"name": "q4-affine", "page_size": 4}


def manifest(name, n=8, pages=()):
    return Manifest(name, "fp", "tk", dict(KV), list(range(n)), [{"hash": h, "sha256": None} for h in pages],
                    [{"role": "user", "content": "hi", "end": n}], model="m")


def page(i=0.0):
    return {"0.k.0": np.full((1, 4, 2), i, np.float32), "0.v.0": np.zeros((1, 4, 2), np.float32)}, \
        {"layers": "1", "kinds": "fp"}


# -- a manifest is this session's own, and not older than its last commit ---------------------------------
def test_manifest_copied_from_another_session_is_refused(tmp_path, capfd):
    home = tmp_path
    write_manifest(home, manifest("k1", 8))
    write_manifest(home, manifest("k1", 12))
    d = home / "sessions"
    shutil.copy(d / "k1.json", d / "k2.json")
    with pytest.raises(UserError, match="holds session 'k1'.*justfit sessions rm k2"):
        read_manifest(home, "k2")  # (before: k1's history, served as k2's)
    write_manifest(home, manifest("k3", 5))
    write_manifest(home, manifest("k3", 6))
    shutil.copy(d / "k1.json", d / "k3.json")  # k3's previous commit is still its own: resumed from it
    m = read_manifest(home, "k3")
    assert m.name == "k3" and m.tokens == list(range(5))
    assert "holds session 'k1'" in capfd.readouterr().err


def test_older_commit_put_back_is_refused(tmp_path, capfd):
    home, d = tmp_path, tmp_path / "sessions"
    write_manifest(home, manifest("s", 5))
    old = (d / "s.json").read_bytes()
    for n in (6, 7, 8):
        write_manifest(home, manifest("s", n))
    assert commit_counter(home, "s") == 4 and read_manifest(home, "s").commit == 4
    (d / "s.json").write_bytes(old)  # commit 1 back in place: the previous commit (3) is served, with a warning
    m = read_manifest(home, "s")
    assert m.tokens == list(range(7)) and "an older copy was put back" in capfd.readouterr().err
    (d / "s.prev.json").write_bytes(old)
    with pytest.raises(UserError, match="commit 1, but commit 4 was made before"):
        read_manifest(home, "s")


def test_version1_manifest_still_opens_and_is_upgraded(tmp_path):
    import hashlib

    home = tmp_path
    doc = json.loads(manifest("old", 9).to_bytes())
    doc.pop("checksum"), doc.pop("commit")
    doc["version"] = 1
    body = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    doc["checksum"] = hashlib.sha256(body.encode()).hexdigest()
    path = manifest_path(home, "old")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(doc))
    m = read_manifest(home, "old")
    assert m.tokens == list(range(9)) and m.commit == 0
    write_manifest(home, m)
    assert json.loads(path.read_bytes())["version"] == 2 and read_manifest(home, "old").commit == 1


# -- a page's path holds that page, or is written again -----------------------------------------------------
@pytest.mark.parametrize("junk", ["garbage", "other page", "torn"])
def test_wrong_file_at_a_page_path_is_replaced(tmp_path, junk):
    store = PageStore(tmp_path / "store" / "fp", tmp_path / "store" / "lock")
    h, other = "aa" * 32, "bb" * 32
    store.write(other, *page(2.0))
    store.path(h).parent.mkdir(parents=True, exist_ok=True)
    if junk == "garbage":
        store.path(h).write_bytes(b"not a page at all")
    elif junk == "other page":
        shutil.copy(store.path(other), store.path(h))
    else:
        store.write(h, *page(1.0))
        blob = store.path(h).read_bytes()
        store.path(h).write_bytes(blob[:-8])
        store.known.clear()
    fresh = PageStore(store.root, store.lock_path)  # another process: nothing known yet
    assert not fresh.has_valid(h)
    sha, written = fresh.write(h, *page(1.0))
    assert written > 0  # (before: the file at the path was kept and its checksum named in manifests)
    header, _ = decode_header(store.path(h).read_bytes())
    assert header["__metadata__"]["block_hash"] == h
    assert fresh.write(h, *page(1.0)) == (sha, 0)  # a valid page stays


# -- a deleted lock file does not let a second writer in -----------------------------------------------------
HOLDER = ("import sys; from pathlib import Path; from justfit.statetrans.lock import acquire\n"
          "acquire(Path(sys.argv[1]), 'k5'); print('held', flush=True); sys.stdin.read()\n")
TAKER = ("import sys; from pathlib import Path; from justfit.statetrans.lock import acquire, SessionInUse\n"
         "try:\n    acquire(Path(sys.argv[1]), 'k5'); print('acquired')\n"
         "except SessionInUse as e:\n    print('refused:', e)\n")


def _py(code, home, **kw):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-c", code, str(home)], env=env, text=True, stdout=subprocess.PIPE, **kw)


def test_deleted_lock_file_does_not_let_a_second_writer_in(tmp_path):
    home = tmp_path
    holder = _py(HOLDER, home, stdin=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == "held"
        lock_path(home, "k5").unlink()  # (before: the next process locked a new file and got in)
        out = _py(TAKER, home).communicate(timeout=60)[0]
        assert out.startswith("refused:") and f"in use by process {holder.pid}" in out, out
    finally:
        holder.communicate(input="", timeout=60)
    assert _py(TAKER, home).communicate(timeout=60)[0].strip() == "acquired"  # the holder exited: free


def test_a_holder_remakes_its_deleted_lock_file(tmp_path):
    home = tmp_path
    assert acquire(home, "k6")
    try:
        lock_path(home, "k6").unlink()
        acquire(home, "k6", count=False)  # what a commit does first
        assert lock_path(home, "k6").read_text().strip() == str(os.getpid())
        with pytest.raises(SessionInUse, match="open in this process"):
            acquire(home, "k6", exclusive=True)
    finally:
        release(home, "k6")
    assert not lock_path(home, "k6").exists()


# -- a disk quota: least recently used unpinned sessions go, shared pages stay while used ---------------------
def _sessions(home, names, shared="ee" * 32):
    """Sessions committed in order (oldest first), each with one page of its own and one shared page."""
    from justfit.statetrans.checkpoint import commit

    store = PageStore(home / "store" / "fp", home / "store" / "lock")
    for i, name in enumerate(names):
        own = f"{i + 1:02x}" * 32
        commit(store, home, manifest(name, 8, [shared, own]), [(shared, *page(9.0)), (own, *page(float(i)))], {})
        release(home, name)  # the commit took the session's lock, as a new session's first one does: closed
        time.sleep(0.01)  # distinct commit times: the LRU order
    return store


def test_gc_max_bytes_evicts_least_recently_used_unpinned_sessions(tmp_path, monkeypatch):
    from justfit.statetrans.quota import usage

    home = tmp_path
    monkeypatch.setenv("JUSTFIT_HOME", str(home))
    store = _sessions(home, ["pinned", "open", "old", "mid", "new"])
    r = CliRunner()
    assert r.invoke(app, ["sessions", "pin", "pinned"]).exit_code == 0
    assert r.invoke(app, ["sessions", "pin", "nope"]).exit_code == 2
    old_bytes = manifest_path(home, "old").stat().st_size + store.path("03" * 32).stat().st_size
    holder = _py(HOLDER.replace("'k5'", "'open'"), home, stdin=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == "held"
        out = r.invoke(app, ["sessions", "gc", "--max-bytes", str(usage(home) - old_bytes)])
    finally:
        holder.communicate(input="", timeout=60)
    assert out.exit_code == 0, out.output
    # (before: --max-bytes evicted single pages, least recently read, and never a session)
    assert "removed session 'old'" in out.output and "freed" in out.output, out.output
    names = {m.name for m in list_manifests(home)}
    assert names == {"pinned", "open", "mid", "new"}
    assert not store.path("03" * 32).exists() and store.path("ee" * 32).exists()  # its own page went, the shared stayed
    out = r.invoke(app, ["sessions", "gc", "--max-bytes", "0"])  # everything not pinned (nothing is open now)
    assert {m.name for m in list_manifests(home)} == {"pinned"}
    assert store.path("ee" * 32).exists() and store.path("01" * 32).exists() and not store.path("05" * 32).exists()
    assert "over the 0.0 MB quota" in out.output
    assert r.invoke(app, ["sessions", "gc", "--max-bytes", "lots"]).exit_code == 2


def test_commits_over_the_quota_evict_other_sessions(tmp_path):
    from justfit.statetrans.checkpoint import commit
    from justfit.statetrans.quota import usage

    home = tmp_path
    store = _sessions(home, ["a"])
    store.sessions_cap = usage(home) * 3  # room for about three sessions
    for i, name in enumerate(["b", "c", "d", "e", "f"]):
        own = f"{i + 10:02x}" * 32
        commit(store, home, manifest(name, 8, ["ee" * 32, own]), [(own, *page(float(i)))], {})
        assert usage(home) <= store.sessions_cap
        release(home, name)
        time.sleep(0.01)
    left = {m.name for m in list_manifests(home)}
    assert "f" in left and "a" not in left and 2 <= len(left) <= 4, left


def test_serve_quota_option_is_a_size(monkeypatch):
    r = CliRunner()
    assert "--sessions-max-bytes" in r.invoke(app, ["serve", "--help"]).output
    out = r.invoke(app, ["serve", "--sessions-max-bytes", "lots"])
    assert out.exit_code == 2 and "--sessions-max-bytes 'lots' is not a size" in out.output
    monkeypatch.setenv("JUSTFIT_SESSIONS_MAX_BYTES", "10 parsecs")
    assert r.invoke(app, ["serve"]).exit_code == 2


def test_serve_sets_the_quota_on_the_runtimes_store(monkeypatch, tmp_path):
    import types

    import justfit.runtime
    import justfit.server.app

    store = PageStore(tmp_path / "store" / "fp", tmp_path / "store" / "lock")
    fake = types.SimpleNamespace(index=types.SimpleNamespace(store=store), sharding=types.SimpleNamespace(world_size=1))
    monkeypatch.setattr(justfit.runtime, "Runtime", lambda **kw: fake)
    served = []
    monkeypatch.setattr(justfit.server.app, "serve", lambda rt, host, port, **kw: served.append(rt))
    monkeypatch.setenv("JUSTFIT_SESSIONS_MAX_BYTES", "2GiB")
    assert CliRunner().invoke(app, ["serve"]).exit_code == 0 and served == [fake]
    assert store.sessions_cap == 2 * 2**30
    assert CliRunner().invoke(app, ["serve", "--sessions-max-bytes", "500MB"]).exit_code == 0
    assert store.sessions_cap == 500 * 10**6
