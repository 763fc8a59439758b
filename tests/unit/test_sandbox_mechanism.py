"""The sandbox mechanism itself: fail closed without one, the launcher refuses to run half-confined,
the seccomp program's shape and effect, the Seatbelt profile text (macOS only, so text-tested here)."""

import os
import subprocess
import sys

import pytest

from tests import agents_support  # noqa: F401
from justfit_agents import processes, seatbelt, seccomp
from justfit_agents.sandbox import SandboxError, Workspace, describe

MECH = processes.mechanism()
needs_landlock = pytest.mark.skipif(MECH.name != "landlock", reason=f"needs the Landlock + seccomp sandbox: {MECH.detail}")
AGENTS = os.path.dirname(processes.__file__)


@pytest.fixture
def no_sandbox(monkeypatch):
    monkeypatch.setattr(processes, "mechanism", lambda: processes.Mechanism("", "no Landlock in this kernel"))


def test_fail_closed_without_a_sandbox(tmp_path, no_sandbox):
    ws = Workspace(tmp_path)
    with pytest.raises(SandboxError, match="code tools are disabled: no OS sandbox.*--unsafe-no-sandbox"):
        ws.tools(python=True)
    with pytest.raises(SandboxError, match="disabled"):
        ws.run_python("print(1)")
    assert [t.name for t in ws.tools(write=True)] == ["read_file", "list_dir", "search_files", "write_file"]
    assert "code tools are disabled" in describe()


def test_unsafe_opt_in_runs_unconfined(tmp_path, no_sandbox):
    ws = Workspace(tmp_path, unsafe_no_sandbox=True, timeout=5)
    run = {t.name: t for t in ws.tools(python=True)}["run_python"]
    assert run(code="print(6 * 7)").strip() == "42"
    assert describe(unsafe_no_sandbox=True).startswith("NONE (unsafe_no_sandbox)")


def test_cli_refuses_coding_agent_without_sandbox(tmp_path, no_sandbox):
    from justfit_agents.ready import coding_agent

    with pytest.raises(SandboxError, match="unsafe-no-sandbox"):
        coding_agent(object(), str(tmp_path))


def test_launcher_fails_closed_on_a_bad_step(tmp_path):
    out, rc, _ = processes.run([sys.executable, "-c", "print('ran')"], str(tmp_path), processes.Limits(timeout=10), "bogus")
    assert rc == 126 and "justfit sandbox: mode failed" in out and "ran" not in out
    cfg = '{"mode": "none", "limits": {"AS": "not a number"}}'
    p = subprocess.run([sys.executable, "-I", "-S", processes.LAUNCHER, cfg, "--", "echo", "ran"], capture_output=True, text=True)
    assert p.returncode == 126 and "setrlimit failed" in p.stderr and "ran" not in p.stdout


@pytest.mark.parametrize("machine", sorted(seccomp.ARCHES))
def test_seccomp_program_shape(machine):
    code = seccomp.program(machine)
    assert len(code) % 8 == 0 and 20 < len(code) // 8 < 4096  # BPF_MAXINSNS
    assert code[:8] == bytes([0x20, 0, 0, 0, 4, 0, 0, 0])  # first: load the arch


@pytest.mark.skipif(not seccomp.arch() or sys.platform != "linux", reason="seccomp filter tables exist for Linux x86_64/aarch64 only")
def test_seccomp_filter_effect(tmp_path):
    probe = ("import os, socket, sys\n"
             f"sys.path.insert(0, {AGENTS!r}); import seccomp; seccomp.install()\n"
             "def t(name, f):\n"
             "    try: f(); print(name, 'allowed')\n"
             "    except OSError as e: print(name, 'denied', e.errno)\n"
             "t('socket', lambda: socket.socket())\n"
             "t('unix socket', lambda: socket.socket(socket.AF_UNIX))\n"
             "t('socketpair', lambda: socket.socketpair())\n"
             "t('inet socketpair', lambda: socket.socketpair(socket.AF_INET))\n"
             "t('setsid', os.setsid)\n"
             "import ctypes; libc = ctypes.CDLL(None, use_errno=True)\n"
             "print('unshare', libc.unshare(0x10000000), ctypes.get_errno())\n"
             "pid = os.fork()\n"
             "if pid == 0: os._exit(7)\n"
             "print('fork', os.waitpid(pid, 0)[1] >> 8)\n")
    p = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True, timeout=30)
    out = p.stdout
    assert "socket denied 13" in out and "unix socket denied 13" in out and "socketpair allowed" in out
    assert "inet socketpair denied" in out and "setsid denied 1" in out and "unshare -1 1" in out
    assert "fork 7" in out


def test_seatbelt_profile_text(tmp_path):
    ws, tmp = tmp_path / 'w"s', tmp_path / "t"
    text = seatbelt.profile(["/opt/py"], [str(ws), str(tmp)])
    lines = text.splitlines()
    assert lines[:3] == ["(version 1)", "(deny default)", "(deny network*)"]
    assert '(subpath "/opt/py")' in text and '(subpath "/usr")' in text
    write = next(x for x in lines if x.startswith("(allow file-read* file-write* "))
    assert '\\"' in write and str(tmp) in write and "/usr" not in write
    assert text.count("(") == text.count(")")
    assert not seatbelt.available() or sys.platform == "darwin"


@needs_landlock
def test_describe_and_limits_are_real(tmp_path):
    assert describe().startswith("Landlock ABI")
    ws = Workspace(tmp_path, timeout=5)
    out = ws.run_python("import resource as r\nprint(r.getrlimit(r.RLIMIT_AS)[0], r.getrlimit(r.RLIMIT_FSIZE)[0], r.getrlimit(r.RLIMIT_CPU)[0])")
    assert out.split()[:3] == [str(2 << 30), str(256 << 20), "7"]


@needs_landlock
def test_ordinary_work_still_runs_inside(tmp_path):
    ws = Workspace(tmp_path, timeout=20, shell_allow=["git", "ls", "python3"])
    code = ("import os, subprocess, tempfile, asyncio, json\n"
            "open('out.txt', 'w').write('hi'); os.makedirs('d/e', exist_ok=True); os.rename('out.txt', 'd/e/o.txt')\n"
            "with tempfile.NamedTemporaryFile() as f: f.write(b'x')\n"
            "print(subprocess.run(['ls', 'd/e'], capture_output=True, text=True).stdout.strip())\n"
            "asyncio.run(asyncio.sleep(0)); print(json.dumps({'ok': 1}))\n"
            "import numpy; print(int(numpy.arange(4).sum()))\n")
    out = ws.run_python(code)
    assert out.split() == ["o.txt", '{"ok":', "1}", "6"], out
    assert "Initialized empty Git repository" in ws.shell("git init -q . --template=") or (tmp_path / ".git").is_dir()
    assert (tmp_path / ".git").is_dir()
    assert ws.shell("python3 -c 'print(2 + 2)'").strip() == "4"
