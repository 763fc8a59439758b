"""Attacks on the workspace tools, each counted (tries / blocked). The file-tool attacks run everywhere;
the code-tool attacks need the OS sandbox (Landlock + seccomp) and are skipped, with the reason, where
this kernel has none. The table is printed at the end of the module (and written to
$JUSTFIT_ATTACK_TABLE when set) for docs/reliability.md."""

import json
import os
import socket
import sys
import threading
import time

import pytest

from tests import agents_support  # noqa: F401
from justfit_agents import processes
from justfit_agents.sandbox import Workspace

MECH = processes.mechanism()
needs_landlock = pytest.mark.skipif(MECH.name != "landlock", reason=f"needs the Landlock + seccomp sandbox: {MECH.detail}")
RACE_ROUNDS = 300
TALLY = {}


def count(attack: str, blocked: bool, out: str = ""):
    """Tally one try for the table, and fail the test when it was not blocked."""
    t = TALLY.setdefault(attack, [0, 0])
    t[0] += 1
    t[1] += bool(blocked)
    assert blocked, f"{attack}: not blocked; the tool said: {out[-400:]!r}"


@pytest.fixture(scope="module", autouse=True)
def table(request):
    yield
    rows = [f"| {a} | {t} | {b} |" for a, (t, b) in TALLY.items()]
    text = "\n".join(["| attack | tries | blocked |", "|---|---|---|"] + rows)
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():  # shown in passing runs too (CI log -> docs/reliability.md)
        sys.stderr.write("\n" + text + f"\n[sandbox: {MECH.name or 'none'}: {MECH.detail}]\n")
    if os.environ.get("JUSTFIT_ATTACK_TABLE"):
        with open(os.environ["JUSTFIT_ATTACK_TABLE"], "a") as f:
            f.write(json.dumps(TALLY) + "\n")


@pytest.fixture
def box(tmp_path):
    root = tmp_path / "ws"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("alpha\n")
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP SECRET 4242")
    (tmp_path / "outdir").mkdir()
    (root / "p.txt").write_text(str(secret))  # shell attacks read the target path from here (no '/' in argv)
    ws = Workspace(root, timeout=4.0, max_output=4000, shell_allow=["find", "python3", "git", "env", "xargs", "cat",
                                                                    "ls", "sh", "bash", "curl"],
                   limits=processes.Limits(processes=32, memory_bytes=1 << 30, file_bytes=16 << 20))
    return ws, secret, tmp_path


def leaked(out: str) -> bool:
    return "TOP SECRET 4242" in out


# -- file tools (no OS sandbox needed) -----------------------------------------------------------------
@pytest.mark.parametrize("path", ["../secret.txt", "sub/../../secret.txt", "./../secret.txt", "sub/./../../secret.txt"])
def test_dotdot(box, path):
    ws, secret, tmp = box
    for fn in (lambda: ws.tools(write=True)[0](path=path), lambda: ws.tools(write=True)[3](path=path, content="x")):
        out = fn()
        count("file tools: `..` paths", not leaked(out) and out.startswith("refused") and secret.read_text().startswith("TOP"))


def test_absolute_and_home(box):
    ws, secret, tmp = box
    tools = {t.name: t for t in ws.tools(write=True)}
    for path in (str(secret), "/etc/passwd", "~/secret.txt", "//etc/passwd", "\\etc\\passwd", "C:/x"):
        for out in (tools["read_file"](path=path), tools["write_file"](path=path, content="pwned"),
                    tools["list_dir"](path=path)):
            count("file tools: absolute / ~ paths", out.startswith("refused") and not leaked(out))
    assert secret.read_text() == "TOP SECRET 4242"


def test_symlinks(box):
    ws, secret, tmp = box
    os.symlink(secret, ws.root / "leak")
    os.symlink(tmp / "outdir", ws.root / "out")
    os.symlink("../../secret.txt", ws.root / "sub" / "rel")
    os.symlink("sub/../../secret.txt", ws.root / "twisty")
    os.symlink("a.txt", ws.root / "ok")
    tools = {t.name: t for t in ws.tools(write=True)}
    for path in ("leak", "sub/rel", "twisty", "out/x"):
        out = tools["read_file"](path=path)
        count("file tools: symlinks out", not leaked(out) and "outside" in out)
        out = tools["write_file"](path=path, content="pwned")
        count("file tools: symlinks out", "outside" in out and not (tmp / "outdir" / "x").exists())
    out = tools["list_dir"](path="out")
    count("file tools: symlinks out", "outside" in out)
    out = tools["search_files"](pattern="SECRET")
    count("file tools: symlinks out", not leaked(out))
    assert tools["read_file"](path="ok") == "alpha\n"  # a link that stays inside still works
    assert secret.read_text() == "TOP SECRET 4242"


def test_symlink_swapped_during_call(box):
    """A thread flips `d` between a real folder and a symlink to the outside while the tools run."""
    ws, secret, tmp = box
    outdir = tmp / "outdir"
    (outdir / "secret.txt").write_text("TOP SECRET 4242")
    tools = {t.name: t for t in ws.tools(write=True)}
    d, real, stop = ws.root / "d", ws.root / "real", threading.Event()
    real.mkdir()
    (real / "secret.txt").write_text("inside")

    def flip():
        while not stop.is_set():
            for make in (lambda: os.symlink(outdir, d), lambda: os.rename(real, d)):
                try:
                    make()
                except OSError:
                    pass
                time.sleep(0)
                try:
                    os.rename(d, real) if d.is_dir() and not d.is_symlink() else os.unlink(d)
                except OSError:
                    pass

    th = threading.Thread(target=flip, daemon=True)
    th.start()
    try:
        for i in range(RACE_ROUNDS):
            out = tools["write_file"](path=f"d/w{i}.txt", content="pwned")
            count("file tools: symlink swapped during the call (race)", not list(outdir.glob("w*.txt")))
            out = tools["read_file"](path="d/secret.txt")
            count("file tools: symlink swapped during the call (race)", not leaked(out))
            out = tools["list_dir"](path="d")
            count("file tools: symlink swapped during the call (race)", "secret.txt" not in out or
                  "w" in out or not list(outdir.glob("w*.txt")))
    finally:
        stop.set()
        th.join()
    assert not list(outdir.glob("w*.txt"))


def test_hard_links(box):
    ws, secret, tmp = box
    os.link(secret, ws.root / "hl")
    tools = {t.name: t for t in ws.tools(write=True)}
    out = tools["read_file"](path="hl")
    count("file tools: hard link to an outside file", not leaked(out) and "hard link" in out)
    out = tools["write_file"](path="hl", content="pwned")
    count("file tools: hard link to an outside file", "hard link" in out and secret.read_text() == "TOP SECRET 4242")
    out = tools["search_files"](pattern="SECRET")
    count("file tools: hard link to an outside file", not leaked(out))


def test_write_size_cap_and_special_files(box):
    ws, _, _ = box
    ws.max_write_bytes = 1000
    tools = {t.name: t for t in ws.tools(write=True)}
    out = tools["write_file"](path="big.txt", content="x" * 1001)
    count("file tools: write over the size cap", "limit" in out and not (ws.root / "big.txt").exists())
    os.mkfifo(ws.root / "fifo")
    out = tools["read_file"](path="fifo")  # must not block
    count("file tools: FIFO / device as a file", "not a regular file" in out)
    assert tools["write_file"](path="deep/er/f.txt", content="ok").startswith("wrote 2 bytes")
    assert not [p for p in (ws.root / "deep" / "er").iterdir() if p.name.endswith(".tmp")]


# -- code tools (OS sandbox) ----------------------------------------------------------------------------
def run(ws, code):
    return ws.run_python(code)


def sh(ws, cmd):
    return ws.shell(cmd)


@needs_landlock
def test_code_reads_and_writes_outside(box):
    ws, secret, tmp = box
    attacks = [f"print(open({str(secret)!r}).read())", "print(open('../secret.txt').read())",
               "import os; os.symlink(open('p.txt').read(), 'l'); print(open('l').read())",
               "import os; os.link(open('p.txt').read(), 'h'); print(open('h').read())",
               "print(open('/etc/passwd').read())",
               "import os; print(os.listdir('/root'))",
               "import shutil; shutil.copy(open('p.txt').read(), 'copy'); print(open('copy').read())"]
    for code in attacks:
        out = run(ws, code)
        count("code: read outside (abs, .., symlink, hard link, /etc, copy)", not leaked(out) and "root:" not in out
              and any(why in out for why in ("Permission denied", "cross-device link", "No such file or directory")), out)
    outside = [tmp / "outdir" / "w1", tmp / "w2", "/tmp/justfit-attack-w3"]
    for target in outside:
        out = run(ws, f"open({str(target)!r}, 'w').write('pwned')")
        count("code: write outside", not os.path.exists(target))
    out = run(ws, f"import os; os.symlink({str(tmp / 'outdir')!r}, 'o'); open('o/w4', 'w').write('x')")
    count("code: write outside", not (tmp / "outdir" / "w4").exists())
    out = run(ws, f"import os; os.rename('a.txt', {str(tmp / 'moved')!r})")
    count("code: write outside", not (tmp / "moved").exists())
    assert (ws.root / "a.txt").exists()


@needs_landlock
def test_code_symlink_race_inside_the_sandbox(box):
    ws, secret, tmp = box
    code = ("import os, threading\n"
            "t = open('p.txt').read(); stop = False\n"
            "def flip():\n"
            "    while not stop:\n"
            "        try: os.symlink(t, 'x'); os.unlink('x'); os.symlink('a.txt', 'x'); os.unlink('x')\n"
            "        except OSError: pass\n"
            "th = threading.Thread(target=flip); th.start(); got = 0\n"
            "for i in range(2000):\n"
            "    try: got += 'SECRET' in open('x').read()\n"
            "    except OSError: pass\n"
            "stop = True; th.join(); print('leaks', got)\n")
    out = run(ws, code)
    count("code: symlink swapped during the call (race, 2000 opens)", "leaks 0" in out)


@pytest.fixture
def listener():
    """A loopback TCP listener and a UDP socket that count what reaches them."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(0.1)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.settimeout(0.1)
    hits, stop = [], threading.Event()

    def accept():
        while not stop.is_set():
            try:
                c, _ = srv.accept()
                hits.append("tcp")
                c.close()
            except OSError:
                pass
            try:
                udp.recvfrom(100)
                hits.append("udp")
            except OSError:
                pass

    th = threading.Thread(target=accept, daemon=True)
    th.start()
    yield srv.getsockname()[1], udp.getsockname()[1], hits
    stop.set()
    th.join()
    srv.close()
    udp.close()


@needs_landlock
def test_network(box, listener):
    ws, _, _ = box
    port, uport, hits = listener
    py = [f"import socket; socket.create_connection(('127.0.0.1', {port}), 2)",
          f"import _socket; s = _socket.socket(); s.connect(('127.0.0.1', {port}))",
          f"import importlib, socket; importlib.reload(socket); socket.create_connection(('127.0.0.1', {port}), 2)",
          f"import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.sendto(b'x', ('127.0.0.1', {uport}))",
          f"import socket; s = socket.socket(socket.AF_INET6); s.connect(('::1', {port}))",
          "import socket; print(socket.getaddrinfo('example.com', 80))",
          "import socket; s = socket.socket(socket.AF_UNIX); s.connect('/var/run/docker.sock')",
          "import socket; s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW)",
          ("import ctypes, struct; libc = ctypes.CDLL(None, use_errno=True)\n"
           "fd = libc.socket(2, 1, 0); print('fd', fd)\n"
           f"addr = struct.pack('<HH4s8x', 2, __import__('socket').htons({port}), bytes([127,0,0,1]))\n"
           "print('connect', libc.connect(fd, addr, 16))"),
          ("import ctypes; libc = ctypes.CDLL(None, use_errno=True)\n"
           "print('raw syscall socket', libc.syscall(41, 2, 1, 0))"),
          f"import subprocess; print(subprocess.run(['python3', '-c', 'import socket; socket.create_connection((\"127.0.0.1\", {port}), 2)'], capture_output=True))",
          f"import os; os.system('curl -s -m 2 http://127.0.0.1:{port}/')",
          f"import os; os.system('bash -c \"echo hi > /dev/tcp/127.0.0.1/{port}\"')"]
    for code in py:
        before = len(hits)
        out = run(ws, code)
        time.sleep(0.05)
        count("code: network (socket, _socket, reload, UDP, IPv6, DNS, AF_UNIX, netlink, ctypes, syscall, child python, curl, /dev/tcp)",
              len(hits) == before and "fd 3" not in out and "connect 0" not in out and "raw syscall socket 3" not in out)
    for cmd in (f"curl -s -m 2 http://127.0.0.1:{port}/", f"bash -c 'echo hi > /dev/tcp/127.0.0.1/{port}'",
                f"python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", {port}), 2)'"):
        before = len(hits)
        sh(ws, cmd)
        time.sleep(0.05)
        count("shell: network (curl, bash /dev/tcp, python3 -c)", len(hits) == before)
    assert not hits
    out = run(ws, "import socket; a, b = socket.socketpair(); a.send(b'ok'); print(b.recv(2))")
    assert "b'ok'" in out  # connected AF_UNIX pairs (asyncio, multiprocessing) still work


@needs_landlock
def test_os_system_and_subprocess_stay_confined(box):
    ws, secret, tmp = box
    for code in ("import os; os.system('cat \"$(cat p.txt)\"')",
                 "import subprocess; print(subprocess.run(['cat', open('p.txt').read()], capture_output=True))",
                 "import os; os.execvp('cat', ['cat', open('p.txt').read()])",
                 "import subprocess; subprocess.run(['sh', '-c', 'echo x > \"$(dirname \"$(cat p.txt)\")/w5\"'])"):
        out = run(ws, code)
        count("code: os.system / subprocess / exec", not leaked(out) and not (tmp / "w5").exists())


@needs_landlock
def test_fork_loop_is_bounded(box):
    ws, _, _ = box
    code = ("import os, time\nn = 0\n"
            "for i in range(300):\n"
            "    try:\n"
            "        if os.fork() == 0:\n"
            "            time.sleep(30); os._exit(0)\n"
            "        n += 1\n"
            "    except OSError:\n"
            "        break\n"
            "print('forked', n)\n")
    t = time.perf_counter()
    out = run(ws, code)
    n = int(out.split("forked")[1].split()[0]) if "forked" in out else 0
    count("code: os.fork loop (300 tries, cap 32 processes)", n < 32)
    assert time.perf_counter() - t < 30


@needs_landlock
def test_no_child_outlives_the_call(box):
    ws, _, _ = box
    # a snippet that ends at once but leaves a child holding stdout: output kept, not "timed out", child killed
    t = time.perf_counter()
    out = run(ws, "import subprocess; p = subprocess.Popen(['sleep', '60.0301']); print('quick done')")
    assert "quick done" in out and "timed out" not in out and time.perf_counter() - t < ws.timeout, out
    # a daemonised grandchild (double fork, setsid refused) and a timed-out main process
    out = run(ws, "import os, time, subprocess\n"
                  "try: os.setsid(); print('setsid ok')\nexcept OSError as e: print('setsid', e)\n"
                  "p = subprocess.Popen(['sh', '-c', 'sleep 60.0302 &']); print('partial output'); time.sleep(60)")
    assert "timed out" in out and "partial output" in out and "setsid ok" not in out
    time.sleep(0.2)
    for mark in ("60.0301", "60.0302"):  # pids inside the call's PID namespace mean nothing here: find them by argv
        count("code: child left running after the call / timeout", not _running(["sleep", mark]))


def _running(argv) -> bool:
    """Whether a live (not zombie) process on this machine has exactly this argv."""
    want = ("\0".join(argv) + "\0").encode()
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if f.read() == want and "zombie" not in open(f"/proc/{d}/status").read().lower():
                    return True
        except OSError:
            pass
    return False


@needs_landlock
def test_memory_and_file_size_limits(box):
    ws, _, _ = box
    out = run(ws, "b = bytearray(8 << 30); print('allocated', len(b))")
    count("code: 8 GB allocation", "MemoryError" in out and "allocated" not in out)
    out = run(ws, "import numpy as np\ntry:\n    a = np.ones(1 << 30)\n    print('allocated')\nexcept MemoryError as e: print('MemoryError')")
    count("code: 8 GB allocation", "allocated" not in out)
    out = run(ws, "f = open('big', 'wb')\nfor i in range(10 << 10): f.write(b'x' * (1 << 20))")
    size = (ws.root / "big").stat().st_size if (ws.root / "big").exists() else 0
    count("code: 10 GB file write (FSIZE 16 MiB)", size <= 16 << 20)


@needs_landlock
def test_parent_secrets_and_ptrace(box, monkeypatch):
    ws, _, _ = box
    monkeypatch.setenv("JUSTFIT_TEST_API_KEY", "sk-parent-secret")
    ppid = os.getpid()
    for code in ("import os; print(dict(os.environ))", "print(open('/proc/self/environ').read())",
                 f"print(open('/proc/{ppid}/environ').read())", "import os; print(open(f'/proc/{os.getppid()}/environ').read())",
                 f"print(open('/proc/{ppid}/cmdline').read())"):
        out = run(ws, code)
        count("code: parent's secrets (env, /proc/*/environ)", "sk-parent-secret" not in out)
    attacks = [f"import ctypes; libc = ctypes.CDLL(None, use_errno=True); print('ptrace', libc.ptrace(16, {ppid}, 0, 0))",
               f"import os, signal; os.kill({ppid}, signal.SIGCONT); print('signalled')",
               f"import ctypes; libc = ctypes.CDLL(None, use_errno=True); print('vm', libc.process_vm_readv({ppid}, 0, 0, 0, 0, 0))",
               f"print(open('/proc/{ppid}/mem', 'rb').read(1))"]
    for code in attacks:
        out = run(ws, code)
        count("code: ptrace / signal / memory of the parent", "ptrace 0" not in out and "signalled" not in out
              and "vm 0" not in out and "b'" not in out)


@needs_landlock
def test_shell_allowlist_bypasses_are_contained(box, listener):
    ws, secret, tmp = box
    (ws.root / "names.txt").write_text(str(secret) + "\n")
    os.symlink(secret, ws.root / "leak")
    read_attacks = ["python3 -c 'print(open(open(\"p.txt\").read()).read())'",
                    "find . -maxdepth 0 -exec sh -c 'cat \"$(cat p.txt)\"' ;",
                    "git -c alias.x='!sh -c \"cat \\\"$(cat p.txt)\\\"\"' x",
                    "env sh -c 'cat \"$(cat p.txt)\"'",
                    "xargs -a names.txt cat",
                    "sh -c 'cat < \"$(cat p.txt)\"'",
                    "bash -c 'exec 3<\"$(cat p.txt)\"; cat <&3'",
                    "cat leak",
                    "git --no-pager -c core.pager=cat show --no-index leak",
                    "env python3 -c 'import os; os.system(\"cat \" + open(\"p.txt\").read())'"]
    for cmd in read_attacks:
        out = sh(ws, cmd)
        count("shell: allowlist bypasses reading outside (python3 -c, find -exec, git -c alias, env, xargs, <, symlink)",
              not leaked(out))
    write_attacks = ["sh -c 'echo pwned > \"$(dirname \"$(cat p.txt)\")/w6\"'",
                     "find . -maxdepth 0 -exec sh -c 'echo pwned > \"$(dirname \"$(cat p.txt)\")/w6\"' ;",
                     "python3 -c 'import os; open(os.path.dirname(open(\"p.txt\").read()) + \"/w6\", \"w\")'"]
    for cmd in write_attacks:
        sh(ws, cmd)
        count("shell: allowlist bypasses writing outside (redirection, find -exec, python3 -c)", not (tmp / "w6").exists())
    assert secret.read_text() == "TOP SECRET 4242"
