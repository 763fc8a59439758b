"""`justfit sessions list|show|rm|gc` on a store written through StateTrans' commit path (no model)."""

import numpy as np
from typer.testing import CliRunner

from justfit.cli import app
from justfit.statetrans.checkpoint import commit
from justfit.statetrans.manifest import Manifest
from justfit.statetrans.store import PageStore


def _store(home):
    store = PageStore(home / "store" / "fp", home / "store" / "lock")
    pages = {h: ({"0.k.0": np.full((2, 32, 8), i, np.float32), "0.v.0": np.zeros((2, 32, 8), np.float32)},
                 {"layers": "1", "kinds": "fp"}) for i, h in enumerate(["aa" * 32, "bb" * 32, "cc" * 32])}
    m = Manifest("chat1", "fp", "tk", {"name": "q4-affine", "page_size": 32}, list(range(70)),
                 [{"hash": "aa" * 32, "sha256": None}, {"hash": "bb" * 32, "sha256": None}],
                 [{"role": "user", "content": "hello there", "end": 10}], model="default")
    commit(store, home, m, [(h, t, meta) for h, (t, meta) in pages.items()], {})
    return store


def test_sessions_cli(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("JUSTFIT_HOME", str(home))
    store = _store(home)
    r = CliRunner()
    out = r.invoke(app, ["sessions", "list"])
    assert out.exit_code == 0 and "chat1" in out.output and "70" in out.output
    out = r.invoke(app, ["sessions", "show", "chat1"])
    assert out.exit_code == 0 and "hello there" in out.output and "q4-affine" in out.output
    out = r.invoke(app, ["sessions", "gc"])                  # the unreferenced page goes, the others stay
    assert out.exit_code == 0 and not store.path("cc" * 32).exists() and store.path("aa" * 32).exists()
    out = r.invoke(app, ["sessions", "show", "nope"])
    assert out.exit_code == 2 and "no session named" in out.output
    out = r.invoke(app, ["sessions", "rm", "../x"])
    assert out.exit_code == 2 and "invalid session name" in out.output
    assert r.invoke(app, ["sessions", "rm", "chat1"]).exit_code == 0
    r.invoke(app, ["sessions", "gc"])
    assert store.pages() == []
    assert "no sessions" in r.invoke(app, ["sessions", "list"]).output


def test_session_chat_repl_keeps_turns_across_a_restart(tmp_path, monkeypatch):
    """`justfit chat --session`: the REPL's turns land in the session and a new Runtime resumes them."""
    import builtins

    from statetrans_util import runtime, tiny_model_folder

    from justfit.chat import session_chat

    folder, home = tiny_model_folder(tmp_path / "models"), tmp_path / "home"
    lines = iter(["hello there", "/stats", "and again", "/exit", "never read"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    session_chat(runtime(folder, home), "talk", None, None, {"max_tokens": 3})
    assert next(lines) == "never read"  # /exit ended the loop
    resumed = runtime(folder, home).session("talk")
    users = [m["content"] for m in resumed.messages if m["role"] == "user"]
    assert users == ["hello there", "and again"] and len(resumed.messages) == 4
