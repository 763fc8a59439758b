"""Validation at the storage boundaries: token ids against the vocabulary, manifests as a
typed schema (a wrong type is damage, recovered from the previous commit), S.json missing or looping,
full-match session names, one writer process per session, junk model folders exit 2."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from statetrans_util import WORDS, runtime, tiny_model_folder
from storage_fuzz import FIELDS, WRONG_VALUES, _resign, _set

from justfit.errors import UserError
from justfit.models import check_token_ids
from justfit.statetrans import lock
from justfit.statetrans.manifest import Manifest, ManifestError, check_name, read_manifest, write_manifest

ROOT = Path(__file__).resolve().parents[2]
KV = {"name": "q4-affine", "bits": 4, "format": "affine", "group_size": 64, "page_size": 4,
      "quantized_kv_start": 0, "page_format_version": 1}


def manifest(name="s", n=10, **kw):
    return Manifest(name, "m" * 16, "t" * 16, dict(KV), list(range(n)), [{"hash": "ab" * 32, "sha256": None}],
                    [{"role": "user", "content": "hi", "end": n}], open_page={"hash": "cd" * 32, "sha256": None, "tokens": 2},
                    **kw)


# -- token ids -----------------------------------------------------------------------------------------
def test_check_token_ids():
    assert check_token_ids([0, 5, np.int32(9)], 10) == [0, 5, 9]
    assert check_token_ids(np.arange(4), 10) == [0, 1, 2, 3] and check_token_ids([], 10) == []
    for bad, msg in (([10], "token id 10 at position 0 is outside the vocabulary \\(0..9\\)"),
                     ([1, -1], "token id -1 at position 1"), ([2**31], "token id 2147483648"),
                     ([10**30], "outside"), ([1.0], "not an integer"), ([True], "not an integer"),
                     (["7"], "not an integer"), ([[1]], "not an integer"), ([None], "not an integer")):
        with pytest.raises(UserError, match=msg):
            check_token_ids(bad, 10)
    with pytest.raises(UserError, match="2147483648"):
        check_token_ids([2**31], None)


# -- typed manifests ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("field", FIELDS)
def test_wrong_types_are_damage_never_internal_errors(tmp_path, field, capfd):
    home = tmp_path
    write_manifest(home, manifest(n=10))
    write_manifest(home, manifest(n=12))
    path = home / "sessions" / "s.json"
    refused = 0
    for value in WRONG_VALUES:
        doc = json.loads(path.read_bytes())
        try:
            _set(doc, field, value)
        except (IndexError, KeyError, TypeError):
            continue
        blob = _resign(doc)
        try:
            Manifest.from_bytes(blob)
            continue  # some values are valid for some fields ("" for parent, 0 for a token ...)
        except ManifestError as e:
            assert str(e)
        backup = path.read_bytes()
        path.write_bytes(blob)
        m = read_manifest(home, "s")  # falls back to the previous commit, with one warning line
        assert m.tokens == list(range(10)) and "resuming from the previous commit" in capfd.readouterr().err
        path.write_bytes(backup)
        refused += 1
    assert refused >= 3


def test_tokens_outside_the_vocabulary_are_damage(tmp_path, capfd):
    write_manifest(tmp_path, manifest(n=10))
    write_manifest(tmp_path, manifest(n=12))
    assert read_manifest(tmp_path, "s", vocab_size=12).tokens == list(range(12))
    m = read_manifest(tmp_path, "s", vocab_size=11)  # token 11 is outside: back to the commit before
    assert m.tokens == list(range(10)) and "outside the vocabulary" in capfd.readouterr().err
    with pytest.raises(UserError, match="no good previous commit"):
        read_manifest(tmp_path, "s", vocab_size=5)


@pytest.mark.parametrize("how", ["deleted", "symlink loop", "a folder", "truncated"])
def test_missing_or_looping_manifest_falls_back_to_prev(tmp_path, how, capfd):
    write_manifest(tmp_path, manifest(n=10))
    write_manifest(tmp_path, manifest(n=12))
    path = tmp_path / "sessions" / "s.json"
    path.unlink()
    if how == "symlink loop":
        os.symlink("s.json", path)
    elif how == "a folder":
        path.mkdir()
    elif how == "truncated":
        path.write_bytes(b'{"checksum": ')
    m = read_manifest(tmp_path, "s")
    assert m is not None and m.tokens == list(range(10))
    assert "resuming from the previous commit s.prev.json" in capfd.readouterr().err


def test_no_manifest_at_all_is_a_new_session_and_rm_removes_backup_first(tmp_path):
    from justfit.statetrans.manifest import remove_manifest

    assert read_manifest(tmp_path, "s") is None
    write_manifest(tmp_path, manifest(n=10))
    write_manifest(tmp_path, manifest(n=12))
    assert remove_manifest(tmp_path, "s") and read_manifest(tmp_path, "s") is None
    assert not list((tmp_path / "sessions").glob("s*"))


@pytest.mark.parametrize("bad", ["abc\n", "abc\r", "\nabc", ".hidden", "a/b", "..", "", "x" * 129, "a b", "s.prev",
                                 "ok\x00", 5, None])
def test_session_names_full_match(bad):
    with pytest.raises(UserError, match="invalid session name"):
        check_name(bad)
    assert check_name("ok-1.2_x") == "ok-1.2_x"


# -- one writer per session ---------------------------------------------------------------------------------
HOLD = ("import sys, time; from pathlib import Path; from justfit.statetrans import lock\n"
        "lock.acquire(Path(sys.argv[1]), 's'); print('held', flush=True); time.sleep(60)\n")


def _holder(home):
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(home)], stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.stdout.readline().strip() == "held"
    return p


def test_session_lock_between_processes_and_stale_lock(tmp_path):
    holder = _holder(tmp_path)
    try:
        with pytest.raises(lock.SessionInUse, match=f"session 's' is in use by process {holder.pid}"):
            lock.acquire(tmp_path, "s")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert lock.lock_path(tmp_path, "s").read_text().strip() == str(holder.pid)  # the stale file is still there
    assert lock.acquire(tmp_path, "s") and lock.acquire(tmp_path, "s")  # taken over; shared in-process
    assert lock.lock_path(tmp_path, "s").read_text().strip() == str(os.getpid())
    lock.release(tmp_path, "s")
    assert lock.lock_path(tmp_path, "s").exists()
    lock.release(tmp_path, "s")
    assert not lock.lock_path(tmp_path, "s").exists()


# -- through Session.open on a tiny model --------------------------------------------------------------------
@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("tiny"))


def test_session_in_use_by_another_process(folder, tmp_path):
    home = tmp_path / "home"
    holder = subprocess.Popen([sys.executable, "-c", HOLD.replace("'s'", "'busy'"), str(home)], stdout=subprocess.PIPE,
                              text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert holder.stdout.readline().strip() == "held"
    rt = runtime(folder, home)
    try:
        with pytest.raises(UserError, match=f"session 'busy' is in use by process {holder.pid}"):
            rt.session("busy")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    s = rt.session("busy")  # the owner died: its lock is stale and taken over
    s.generate(WORDS, max_tokens=2)
    s.close()
    assert not lock.lock_path(home, "busy").exists()


def test_out_of_range_ids_in_a_manifest_are_refused(folder, tmp_path):
    """Manifests with a valid checksum but ids outside the vocabulary: a clear error before any id
    reaches the model (this used to segfault)."""
    rt = runtime(folder, tmp_path / "home")
    s = rt.session("ids")
    s.generate(WORDS, max_tokens=2)
    s.close()
    src = tmp_path / "home" / "sessions" / "ids.json"
    for bad in (300, 2**31, -1, 10**9):
        home = tmp_path / str(bad)
        (home / "sessions").mkdir(parents=True)
        doc = json.loads(src.read_bytes())
        doc["tokens"][3] = bad
        (home / "sessions" / "ids.json").write_bytes(_resign(doc))
        with pytest.raises(UserError, match="outside the vocabulary|bad field tokens"):
            runtime(folder, home).session("ids")


# -- junk model folders ----------------------------------------------------------------------------------------
def _junk(tmp_path, good: Path):
    import shutil
    import struct

    out = {}
    for name in ("torn-weights", "config-without-fields", "broken-template", "bad-json"):
        d = tmp_path / name
        d.mkdir()
        shutil.copy(good / "config.json", d)
        for t in good.glob("tokenizer*"):
            shutil.copy(t, d)
        shutil.copy(next(good.glob("*.safetensors")), d / "model.safetensors")
        out[name] = d
    (out["torn-weights"] / "model.safetensors").write_bytes(os.urandom(1000))
    (out["config-without-fields"] / "config.json").write_text('{"model_type": "llama"}')
    cfg = json.loads((good / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for %}"
    (out["broken-template"] / "tokenizer_config.json").write_text(json.dumps(cfg))
    (out["bad-json"] / "config.json").write_text("{")
    h = json.dumps({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    (out["bad-json"] / "model.safetensors").write_bytes(struct.pack("<Q", len(h)) + h + bytes(8))
    return out


def test_junk_model_folders_are_user_errors(folder, tmp_path):
    from justfit.models import load

    for d in _junk(tmp_path, folder).values():
        with pytest.raises(UserError, match="could not load model|broken chat template"):
            load(str(d))


def test_junk_model_folder_cli_exit_2(folder, tmp_path):
    d = _junk(tmp_path, folder)["torn-weights"]
    p = subprocess.run([sys.executable, "-c", "from justfit.cli import main; main()", "chat", "-m", str(d), "-p", "hi"],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 2 and "could not load model" in p.stderr and "Traceback" not in p.stderr


def test_out_of_range_ids_through_generate_are_user_errors(folder, tmp_path):
    """The generation path calls check_tokens (= check_token_ids): never a segfault, never garbage."""
    rt = runtime(folder, tmp_path / "home")
    for i, bad in enumerate(([10**9], [-1], [300], [1, 2.5])):
        with pytest.raises(UserError, match="outside the vocabulary|not an integer|prompt must be"):
            rt.session(f"gen{i}").generate(bad, max_tokens=2)


def test_a_refused_turn_leaves_the_session_usable(folder, tmp_path):
    s = runtime(folder, tmp_path / "home").session("gen")
    with pytest.raises(UserError, match="outside the vocabulary"):
        s.generate([10**9], max_tokens=2)
    assert s.generate([1, 2, 3], max_tokens=2).tokens
