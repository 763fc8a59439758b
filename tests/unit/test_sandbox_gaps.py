"""The sandbox's second wall: what Landlock alone left open. Processes outside the sandbox cannot be
reached through rlimits, nothing outside the workspace can be stat-ed or watched, memory, processes and
temporary disk are totals per tool call, the file tools neither hang nor crash on hostile input, and a
Landlock ABI without scoping is refused (fail closed)."""

import os
import resource
import subprocess
import sys
import tempfile

import pytest

from tests import agents_support  # noqa: F401
from justfit_agents import landlock, processes
from justfit_agents.sandbox import Workspace
from justfit_agents.trees import remove_tree

MECH = processes.mechanism()
needs_landlock = pytest.mark.skipif(MECH.name != "landlock", reason=f"needs the Landlock + seccomp sandbox: {MECH.detail}")
DEEP = 1200


@pytest.fixture
def deep_cleanup(tmp_path):
    """pytest's own clean-up of old tmp_path folders recurses (RecursionError on a deep tree): remove
    every deep tree a test made before it ends."""
    yield
    remove_tree(str(tmp_path))


def _deep_tree(top: str, depth: int, leaf: str = None):
    """depth nested folders 'd/d/d...' under top, made fd-relative (the path is longer than PATH_MAX)."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nfd
    if leaf:
        f = os.open("leaf.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        os.write(f, leaf.encode())
        os.close(f)
    os.close(fd)


@needs_landlock
def test_prlimit_cannot_reach_other_processes(tmp_path):
    victim = subprocess.Popen(["sleep", "30"])
    try:
        before = resource.prlimit(victim.pid, resource.RLIMIT_NOFILE)
        ws = Workspace(tmp_path, timeout=10)
        code = ("import resource, os\n"
                f"for pid, new in (({victim.pid}, (7, 7)), ({os.getpid()}, None), (os.getppid(), None)):\n"
                "    if pid == 0:\n"
                "        print('denied: no parent visible'); continue\n"
                "    try:\n"
                "        resource.prlimit(pid, resource.RLIMIT_NOFILE, *([new] if new else []))\n"
                "        print('reached', pid)\n"
                "    except OSError as e:\n"
                "        print('denied', type(e).__name__)\n")
        out = ws.run_python(code)
        assert "reached" not in out and out.count("denied") == 3, out
        assert resource.prlimit(victim.pid, resource.RLIMIT_NOFILE) == before
        assert victim.poll() is None
        own = ws.run_python("import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64)); print('own ok')")
        assert own.strip() == "own ok"  # a process may still lower its own limits (libc's setrlimit is prlimit(0))
    finally:
        victim.kill()
        victim.wait()


@needs_landlock
def test_the_launching_agent_survives_prlimit_on_its_parent(tmp_path):
    """The red-team line itself, run by a separate agent process (on the old code it killed that agent)."""
    agent = ("import sys; sys.path[:0] = sys.argv[2:]\nfrom justfit_agents.sandbox import Workspace\n"
             "out = Workspace(sys.argv[1], timeout=10).run_python("
             "'import resource, os; resource.prlimit(os.getppid(), resource.RLIMIT_CPU, (1, 1)); print(\"set\")')\n"
             "import time, resource; t = time.process_time()\nwhile time.process_time() - t < 1.5: pass\n"
             "print('agent alive', resource.getrlimit(resource.RLIMIT_CPU))\n")
    p = subprocess.run([sys.executable, "-c", agent, str(tmp_path)] + sys.path, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and "agent alive (-1, -1)" in p.stdout, (p.returncode, p.stdout, p.stderr)


@needs_landlock
def test_stat_and_inotify_outside_the_workspace_fail(tmp_path):
    root = tmp_path / "ws"
    root.mkdir()
    (tmp_path / "secret.txt").write_text("x" * 4242)
    (tmp_path / "outdir").mkdir()
    ws = Workspace(root, timeout=10)
    code = ("import os, ctypes\n"
            f"for p in ('/etc/shadow', '/etc/passwd', {str(tmp_path / 'secret.txt')!r}, {str(tmp_path / 'outdir')!r}):\n"
            "    try:\n"
            "        print('seen', p, os.stat(p).st_size)\n"
            "    except OSError as e:\n"
            "        print('hidden', type(e).__name__)\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "fd = libc.inotify_init1(0)\n"
            f"w = libc.inotify_add_watch(fd, {str(tmp_path / 'outdir').encode()!r}, 0x100 | 0x200)\n"
            "print('watch', 'refused' if w < 0 else 'granted')\n"
            "print('own', os.stat('.').st_mode > 0)\n"
            "try:\n"
            f"    print('around', sorted(os.listdir({str(tmp_path)!r})))\n"
            "except OSError as e:\n"
            "    print('around', type(e).__name__)\n")
    out = ws.run_python(code)
    assert "seen" not in out and out.count("hidden") == 4, out
    assert "watch refused" in out and "own True" in out, out
    assert "around ['ws']" in out or "around PermissionError" in out, out  # nothing else above the workspace


@needs_landlock
def test_private_dev_shm_for_multiprocessing(tmp_path):
    """multiprocessing needs POSIX semaphores in /dev/shm: the call gets its own, never the host's."""
    host = None
    if os.path.isdir("/dev/shm"):
        host = tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="justfit-host-")
    try:
        code = ("import multiprocessing as mp, os\nif __name__ == '__main__':\n"
                "    with mp.Pool(2) as p: print(p.map(abs, [-1, -2]))\n"
                "    print('shm', sorted(n for n in os.listdir('/dev/shm') if n.startswith('justfit-host-')))\n")
        out = Workspace(tmp_path, timeout=30).run_python(code)
        assert "[1, 2]" in out and "shm []" in out, out
    finally:
        if host:
            host.close()


def _sysv_keys():
    try:
        with open("/proc/sysvipc/shm") as f:
            return {line.split()[0] for line in f.readlines()[1:]}
    except OSError:
        return set()


@needs_landlock
def test_sysv_shared_memory_stays_inside_the_call(tmp_path):
    """SysV IPC lives in the IPC namespace, not the filesystem: without its own, a call could open the
    host's segments or leave segments that outlive it."""
    key = 0x4A46_0000 + os.getpid() % 0xFFFF
    code = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"print('made', libc.shmget({key}, 1 << 20, 0o1000 | 0o666) >= 0)\n")  # IPC_CREAT, left behind
    out = Workspace(tmp_path, timeout=10).run_python(code)
    assert "made True" in out, out
    left = str(key) in _sysv_keys()
    if left:  # the old code leaves it behind: remove it so it does not outlive the test run either
        libc = __import__("ctypes").CDLL(None)
        libc.shmctl(libc.shmget(key, 0, 0), 0, None)  # IPC_RMID
    assert not left, "a SysV segment made in the call outlived it in the host's IPC namespace"


@needs_landlock
def test_memory_is_a_total_per_call(tmp_path):
    ws = Workspace(tmp_path, timeout=20, limits=processes.Limits(memory_bytes=160 << 20, processes=32))
    code = ("import os, time\n"
            "kids = []\n"
            "for _ in range(6):\n"
            "    pid = os.fork()\n"
            "    if pid == 0:\n"
            "        try:\n"
            "            b = bytearray(60 << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep(2); os._exit(0)\n"
            "        except MemoryError:\n"
            "            os._exit(3)\n"
            "    kids.append(pid)\n"
            "ok = sum(os.waitstatus_to_exitcode(os.waitpid(k, 0)[1]) == 0 for k in kids)\n"
            "print('held', ok)\n")
    out = ws.run_python(code)
    held = [int(w.split()[1]) for w in out.splitlines() if w.startswith("held ")]
    assert not held or held[0] <= 2, out  # 6 x 60 MiB at once cannot fit in a 160 MiB total


@needs_landlock
def test_temporary_disk_is_a_total_per_call(tmp_path):
    cap = 4 << 20
    ws = Workspace(tmp_path / ".", timeout=20, limits=processes.Limits(file_bytes=cap, disk_bytes=2 * cap))
    code = ("import os, tempfile\n"
            "total = 0\n"
            "for i in range(8):\n"
            "    p = os.path.join(tempfile.gettempdir(), f'f{i}')\n"
            "    try:\n"
            f"        with open(p, 'wb') as f: f.write(b'x' * {cap})\n"
            "    except OSError:\n"
            "        pass\n"
            "    total += os.path.getsize(p) if os.path.exists(p) else 0\n"
            "print('total', total)\n")
    out = ws.run_python(code)
    total = int(out.split("total")[1].split()[0])
    assert total <= 2 * cap, out


@needs_landlock
def test_workspace_writes_are_a_total_per_call(tmp_path):
    cap = 4 << 20
    ws = Workspace(tmp_path, timeout=20, limits=processes.Limits(file_bytes=cap, workspace_bytes=2 * cap))
    code = ("for i in range(8):\n"
            "    try:\n"
            f"        with open(f'f{{i}}', 'wb') as f: f.write(b'x' * {cap})\n"
            "    except OSError as e:\n"
            "        print('refused', e.errno)\n")
    out = ws.run_python(code)
    total = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert total <= 2 * cap, (total, out)
    assert "refused 28" in out, out  # ENOSPC: the program is told, not killed


@needs_landlock
def test_workspace_changes_come_back(tmp_path):
    """Inside, the workspace is an overlay; after the call every kind of change is in the real folder."""
    for name, text in (("keep.txt", "old"), ("gone.txt", "x"), ("moved.txt", "m"), ("d/inner.txt", "i")):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "e").mkdir()
    code = ("import os, shutil\n"
            "open('keep.txt', 'a').write('+new')\nos.unlink('gone.txt')\nos.rename('moved.txt', 'moved2.txt')\n"
            "shutil.rmtree('d')\nos.rmdir('e'); open('e', 'w').write('now a file')\n"
            "os.makedirs('n/m'); open('n/m/x.txt', 'w').write('deep')\nos.symlink('keep.txt', 'link')\n"
            "open('run.sh', 'w').write('#!/bin/sh'); os.chmod('run.sh', 0o755)\n"
            "os.makedirs('d'); open('d/fresh.txt', 'w').write('f')\nprint('done')\n")
    out = Workspace(tmp_path, timeout=20).run_python(code)
    assert out.strip() == "done", out
    assert (tmp_path / "keep.txt").read_text() == "old+new"
    assert not (tmp_path / "gone.txt").exists() and not (tmp_path / "moved.txt").exists()
    assert (tmp_path / "moved2.txt").read_text() == "m"
    assert sorted(os.listdir(tmp_path / "d")) == ["fresh.txt"]  # the old folder's content is gone
    assert (tmp_path / "e").read_text() == "now a file"
    assert (tmp_path / "n/m/x.txt").read_text() == "deep"
    assert os.readlink(tmp_path / "link") == "keep.txt"
    assert os.stat(tmp_path / "run.sh").st_mode & 0o777 == 0o755
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".copyback")]


@needs_landlock
def test_writes_before_a_timeout_are_kept(tmp_path):
    out = Workspace(tmp_path, timeout=2).run_python("open('part.txt', 'w').write('before')\nimport time; time.sleep(30)")
    assert "timed out after 2 s" in out, out
    assert (tmp_path / "part.txt").read_text() == "before"


@needs_landlock
def test_copy_back_never_follows_a_planted_symlink(tmp_path):
    root, outside = tmp_path / "ws", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    ws = Workspace(root, timeout=20)
    ws.run_python(f"import os; os.symlink({str(outside)!r}, 'esc'); os.symlink({str(outside / 'f.txt')!r}, 'f.txt')")
    assert os.path.islink(root / "esc")  # call 1 left a symlink to an outside folder and file
    out = ws.run_python("import os\nfor n in ('esc', 'f.txt'):\n    os.unlink(n)\n"
                        "os.mkdir('esc'); open('esc/pwn', 'w').write('x'); open('f.txt', 'w').write('x'); print('ok')")
    assert "ok" in out, out
    assert os.listdir(outside) == []
    assert (root / "esc").is_dir() and not (root / "esc").is_symlink() and (root / "esc/pwn").read_text() == "x"
    assert not (root / "f.txt").is_symlink()


@needs_landlock
def test_file_count_is_a_total_per_call(tmp_path):
    code = ("import os\nn = 0\ntry:\n    while n < 5000:\n        os.close(os.open(f'e{n}', os.O_CREAT | os.O_WRONLY)); n += 1\n"
            "except OSError as e:\n    print('stopped', e.errno)\nprint('files', n)\n")
    try:
        out = Workspace(tmp_path, timeout=60, limits=processes.Limits(files=2000)).run_python(code)
        n = int(out.split("files")[1].split()[0])
        assert "stopped 28" in out and n < 2000, out
    finally:
        remove_tree(str(tmp_path))


def test_regex_search_cannot_hang_the_agent(tmp_path):
    (tmp_path / "a.txt").write_text("a" * 40 + "!\n")
    code = ("import sys; sys.path[:0] = sys.argv[2:]\nfrom justfit_agents.sandbox import Workspace\n"
            "ws = Workspace(sys.argv[1], search_seconds=1.0)\nprint(ws.search_files(r'(a+)+$'))\n"
            "print(ws.search_files(r'(a|aa)+$'))\n"
            "print(ws.search_files(r'a{3}!'))\n")
    try:  # in a child: a hung match holds the GIL, so a thread here could not time it out
        p = subprocess.run([sys.executable, "-c", code, str(tmp_path)] + sys.path, capture_output=True, text=True,
                           timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("search_files was still running after 30 s")
    assert "no match for '(a+)+$'" in p.stdout, p.stdout + p.stderr  # a catastrophic-backtracking pattern: answered at once
    assert "took longer than 1 s" in p.stdout, p.stdout + p.stderr  # one that still backtracks: cut off
    assert "a.txt:1: " in p.stdout  # ordinary patterns still match


def test_search_walks_a_deep_tree(tmp_path, deep_cleanup):
    (tmp_path / "top.txt").write_text("needle at the top\n")
    _deep_tree(str(tmp_path), DEEP, leaf="needle deep down\n")
    out = Workspace(tmp_path).search_files("needle")
    assert "top.txt:1: needle at the top" in out, out
    assert "Recursion" not in out and "error" not in out, out


def test_remove_tree_handles_any_depth(tmp_path, deep_cleanup):
    top = tmp_path / "t"
    top.mkdir()
    _deep_tree(str(top), DEEP, leaf="x")
    remove_tree(str(top))
    assert not top.exists()


@needs_landlock
def test_deep_temp_folder_leaves_nothing_behind(tmp_path, monkeypatch, deep_cleanup):
    systmp = tmp_path / "systmp"
    systmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(systmp))
    ws = Workspace(tmp_path / ".", timeout=20)
    out = ws.run_python(f"import os, tempfile\nos.chdir(tempfile.gettempdir())\nfor _ in range({DEEP}):\n"
                        "    os.mkdir('d'); os.chdir('d')\nprint('deep')")
    assert "deep" in out
    assert os.listdir(systmp) == []


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/setpriv") or not os.path.exists("/usr/bin/python3"),
                    reason="needs root (to switch to uid 65534 with setpriv) and a system /usr/bin/python3")
def test_non_root_user_gets_the_same_walls():
    """As an ordinary user the launcher makes its namespaces inside a user namespace (no root needed)."""
    top = tempfile.mkdtemp(prefix="justfit-nonroot-", dir="/tmp")
    try:
        ws, tmp = os.path.join(top, "ws"), os.path.join(top, "tmp")
        os.mkdir(ws)
        os.mkdir(tmp)
        for p in (top, ws, tmp):
            os.chown(p, 65534, 65534)
        with open(os.path.join(top, "secret.txt"), "w") as f:
            f.write("x")
        with open(os.path.join(ws, "old.txt"), "w") as f:
            f.write("x")
        os.chown(os.path.join(ws, "old.txt"), 65534, 65534)
        os.chmod(top, 0o755)
        cfg = processes._config("landlock", ws, tmp, processes.Limits(), None)
        cfg["read"] = [p for p in cfg["read"] if not p.startswith("/root")]  # this venv's Python is not needed
        code = ("import os, resource\nprint('pid', os.getpid())\n"
                f"for p in ('/etc/shadow', {os.path.join(top, 'secret.txt')!r}):\n"
                "    try:\n        os.stat(p); print('seen', p)\n    except OSError:\n        print('hidden')\n"
                "open('x.txt', 'w').write('hi')\nos.unlink('old.txt')\n"
                "try:\n    resource.prlimit(1, resource.RLIMIT_NOFILE); print('reached')\n"
                "except OSError:\n    print('denied')\n")
        import json

        p = subprocess.run(["/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3",
                            "-I", "-S", processes.LAUNCHER, json.dumps(cfg), "--", "/usr/bin/python3", "-I", "-c", code],
                           capture_output=True, text=True, timeout=60, cwd=ws)
        if "justfit sandbox: entering mount and PID namespaces failed" in p.stderr:
            pytest.skip(f"user namespaces are not available to uid 65534 here: {p.stderr.strip()}")
        assert p.returncode == 0 and p.stdout.split() == ["pid", "1", "hidden", "hidden", "denied"], p.stdout + p.stderr
        assert open(os.path.join(ws, "x.txt")).read() == "hi" and os.listdir(ws) == ["x.txt"]  # copied back
    finally:
        remove_tree(top)


def test_landlock_without_scoping_is_refused(monkeypatch):
    monkeypatch.setattr(landlock, "abi", lambda: 5)
    failed = ("justfit sandbox: entering mount and PID namespaces failed: [Errno 1] Operation not permitted", 126, 0)
    monkeypatch.setattr(processes, "run", lambda *a, **k: failed)
    m = processes.mechanism.__wrapped__()
    assert m.name == "" and "ABI 5 has no scoping" in m.detail and "namespaces failed" in m.detail, m.detail
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import landlock\n"
            "landlock.abi = lambda: 5\n"
            "try:\n    landlock.restrict(['/usr'], ['/tmp'])\nexcept OSError as e:\n    print('refused:', e)\n"
            "else:\n    print('restricted without scoping')\n")
    p = subprocess.run([sys.executable, "-I", "-c", code, os.path.dirname(landlock.__file__)],
                       capture_output=True, text=True, timeout=30)
    assert p.stdout.startswith("refused:") and "no scoping" in p.stdout, p.stdout + p.stderr


@needs_landlock
def test_syscalls_newer_than_the_filter_are_refused(tmp_path):
    """Deny by default past the reviewed table: 467-469 (open_tree_attr, file_getattr, file_setattr) exist in
    Linux 6.15-6.17 and answer EFAULT/EINVAL outside; inside they must not reach the kernel (ENOSYS)."""
    code = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "for nr in (467, 468, 469, 1000):\n"
            "    libc.syscall(nr, 0, 0, 0, 0, 0); print(nr, ctypes.get_errno())\n")
    out = Workspace(tmp_path, timeout=10).run_python(code)
    assert out.split() == ["467", "38", "468", "38", "469", "38", "1000", "38"], out


@pytest.mark.skipif(not MECH.cgroup, reason=f"needs a writable cgroup for the per-call totals: {MECH.detail}")
def test_a_call_without_its_cgroup_does_not_run(tmp_path, monkeypatch):
    """Where the machine offers per-call cgroups, a call whose cgroup cannot be made is refused, not run
    without its memory and process totals."""
    from justfit_agents import cgroups

    monkeypatch.setattr(cgroups, "make", lambda *a: None)
    (tmp_path / "ran").mkdir()
    out = Workspace(tmp_path, timeout=10).tools(python=True)[-1](code="import os; os.rmdir('ran'); print('ran')")
    assert out.startswith("the sandbox could not start") and "cgroup" in out, out
    assert (tmp_path / "ran").is_dir()


@needs_landlock
def test_landlock_without_scoping_is_accepted_with_namespaces(monkeypatch):
    monkeypatch.setattr(landlock, "abi", lambda: 5)
    m = processes.mechanism.__wrapped__()
    assert m.name == "landlock" and m.detail.startswith("Landlock ABI 5"), m.detail


def test_seccomp_denies_reaching_other_pids_in_the_program():
    from justfit_agents import seccomp

    for machine in seccomp.ARCHES:
        nr = seccomp.ARCHES[machine][1]
        assert {"prlimit64", "setpriority", "sched_setaffinity"} <= set(nr), machine

