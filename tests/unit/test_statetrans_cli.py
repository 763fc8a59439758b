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


def test_sessions_list_aligns_columns_and_counts_the_open_page(tmp_path, monkeypatch):
    """A session shorter than one page has only its open page: PAGES and DISK count it, not 0 / 0.0 MB; a
    long name does not push its row's columns out of line."""
    home = tmp_path / "home"
    monkeypatch.setenv("JUSTFIT_HOME", str(home))
    store = _store(home)
    page = {"0.k.0": np.ones((64, 20, 64), np.float32), "0.v.0": np.ones((64, 20, 64), np.float32)}  # 0.66 MB
    m = Manifest("a-session-with-a-rather-long-name", "fp", "tk", {"name": "q4-affine", "page_size": 32},
                 list(range(20)), [], [{"role": "user", "content": "hi", "end": 5}], model="default",
                 open_page={"hash": "dd" * 32, "sha256": None, "tokens": 20})
    commit(store, home, m, [("dd" * 32, page, {"layers": "1", "kinds": "fp"})], {})
    out = CliRunner().invoke(app, ["sessions", "list"])
    assert out.exit_code == 0, out.output
    header, *rows = out.output.splitlines()
    for row in rows:
        for col in ("KV", "LAST USE", "PIN", "MODEL"):  # left-aligned: a cell starts where its header does
            at = header.index(col)
            assert row[at - 1] == " " and row[at] != " ", (col, header, row)
        for col in ("TOKENS", "PAGES", "DISK"):  # right-aligned: a cell ends where its header does
            end = header.index(col) + len(col)
            assert row[end - 1] != " " and row[end] == " ", (col, header, row)
    long = next(row for row in rows if row.startswith("a-session"))
    fields = long.split()
    assert fields[1:3] == ["20", "1"] and float(fields[3]) > 0, long  # TOKENS, PAGES, DISK (MB)
    show = CliRunner().invoke(app, ["sessions", "show", "a-session-with-a-rather-long-name"]).output
    assert "0 sealed + 1 open" in show
