"""Sandbox: escapes are refused with a clear message; processes are capped, timed out, offline."""

import os

import pytest

from tests import agents_support  # noqa: F401
from justfit_agents.sandbox import SandboxError, Workspace


@pytest.fixture
def ws(tmp_path):
    root = tmp_path / "ws"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("alpha\nbeta gamma\n")
    (root / "sub" / "b.py").write_text("print('beta')\n")
    (tmp_path / "secret.txt").write_text("TOP SECRET")
    return Workspace(root, timeout=2.0, max_output=200)


def tool(ws, name):
    return {t.name: t for t in ws.tools(write=True, python=True, shell=True)}[name]


def test_inside_paths_work(ws):
    assert tool(ws, "read_file")(path="a.txt").startswith("alpha")
    assert tool(ws, "list_dir")(path=".") == "a.txt\nsub/"
    assert tool(ws, "write_file")(path="new/c.txt", content="hi").startswith("wrote 2 bytes")
    assert (ws.root / "new" / "c.txt").read_text() == "hi"
    assert "sub/b.py:1: print('beta')" in tool(ws, "search_files")(pattern="beta")


@pytest.mark.parametrize("bad", ["../secret.txt", "sub/../../secret.txt", "..", "/etc/passwd", "~/x", "\x00"])
def test_escapes_refused(ws, bad):
    for name, kw in (("read_file", {"path": bad}), ("list_dir", {"path": bad}),
                     ("write_file", {"path": bad, "content": "x"}), ("search_files", {"pattern": "x", "path": bad})):
        out = tool(ws, name)(**kw)
        assert out.startswith("refused:"), (name, bad, out)
    assert not (ws.root.parent / "x").exists()


def test_symlink_escape_refused_inside_link_allowed(ws):
    os.symlink(ws.root.parent / "secret.txt", ws.root / "leak.txt")
    os.symlink(ws.root.parent, ws.root / "up")
    os.symlink(ws.root / "a.txt", ws.root / "ok.txt")
    assert "outside the workspace" in tool(ws, "read_file")(path="leak.txt")
    assert "outside the workspace" in tool(ws, "read_file")(path="up/secret.txt")
    assert "outside the workspace" in tool(ws, "write_file")(path="up/evil.txt", content="x")
    assert not (ws.root.parent / "evil.txt").exists()
    assert tool(ws, "read_file")(path="ok.txt").startswith("alpha")
    assert "TOP SECRET" not in tool(ws, "search_files")(pattern="SECRET")


def test_run_python_cwd_output_cap_timeout_and_no_network(ws):
    run = tool(ws, "run_python")
    assert run(code="import os; print(os.getcwd())").strip() == str(ws.root)
    huge = run(code="print('x' * 100000)")
    assert len(huge) < 400 and "[output cut: showed 200 characters of 100001 bytes]" in huge
    assert "timed out after 2 s" in run(code="import time; time.sleep(30)")
    net = run(code="import socket\ntry:\n    socket.create_connection(('1.1.1.1', 80), 1)\nexcept OSError as e:\n    print('blocked', e)")
    assert "blocked" in net and "Permission denied" in net
    assert "[exit code 1]" in run(code="raise SystemExit(1)")


def test_shell_disabled_unless_allowed(ws):
    assert "shell" not in [t.name for t in ws.tools(shell=True)]
    with pytest.raises(SandboxError, match="disabled"):
        ws.shell("ls")
    allowed = Workspace(ws.root, shell_allow=["ls", "cat"], max_output=200)
    sh = {t.name: t for t in allowed.tools(shell=True)}["shell"]
    assert "a.txt" in sh(command="ls")
    assert sh(command="rm a.txt").startswith("refused: 'rm' is not allowed")
    assert sh(command="cat ../secret.txt").startswith("refused:")
    assert sh(command="cat /etc/passwd").startswith("refused:")
    assert (ws.root / "a.txt").exists()


def test_bad_workspace(tmp_path):
    with pytest.raises(SandboxError):
        Workspace(tmp_path / "missing")
