"""Where the tool sandbox's seccomp allowlist (agents/justfit_agents/seccomp.py) comes from, and a check
that it still fits: run the tools' ordinary workloads (a Python snippet doing file IO, mmap, sqlite,
threads, subprocess, multiprocessing, asyncio, numpy; a shell script using coreutils, grep, find, sed,
awk, tar, gzip, git, sh, bash, python3) unconfined under `strace -f`, list every syscall they made, and
say how the filter treats each one it does not simply allow; then run the same workloads inside the
sandbox and print whether they finished.

Usage: python benchmarks/repro/seccomp_inventory.py   (Linux, strace on PATH, from the repository root)
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "agents"))
from justfit_agents import seccomp  # noqa: E402
from justfit_agents.sandbox import Workspace  # noqa: E402

PYTHON = r"""
import asyncio, hashlib, mmap, os, shutil, signal, socket, sqlite3, subprocess, sys, tempfile, threading, zlib
import multiprocessing as mp
os.makedirs("d/e", exist_ok=True)
with open("d/e/f.txt", "w") as f: f.write("hello\n" * 100)
shutil.copy("d/e/f.txt", "d/g.txt"); os.replace("d/g.txt", "d/i.txt"); os.symlink("i.txt", "d/link")
os.readlink("d/link"); os.chmod("d/i.txt", 0o600); os.utime("d/i.txt"); os.truncate("d/i.txt", 3)
print(sorted(os.listdir("d")), list(os.walk("d"))[0][0])
with open("d/i.txt", "r+b") as f:
    m = mmap.mmap(f.fileno(), 0); m[:1] = b"J"; m.flush(); m.close(); os.fsync(f.fileno())
db = sqlite3.connect("d/x.db"); db.execute("create table t(a)"); db.commit(); db.close()
shutil.rmtree("d")
with tempfile.TemporaryDirectory() as t: open(os.path.join(t, "x"), "w").write("y")
print(zlib.compress(b"x")[:1], hashlib.sha256(b"x").hexdigest()[:4])
ts = [threading.Thread(target=sum, args=(range(10000),)) for _ in range(4)]; [t.start() for t in ts]; [t.join() for t in ts]
print(subprocess.run([sys.executable, "-c", "print('child')"], capture_output=True, text=True).stdout.strip())
print(subprocess.check_output("echo sh; ls | head -1", shell=True, text=True).split()[0])
with mp.Pool(2) as p: print(p.map(abs, [-1, -2]))
async def main():
    r = await asyncio.create_subprocess_exec(sys.executable, "-c", "print(1)", stdout=asyncio.subprocess.PIPE)
    print((await r.communicate())[0])
asyncio.run(main())
a, b = socket.socketpair(); a.send(b"x"); print(b.recv(1))
signal.signal(signal.SIGALRM, lambda *a: None); signal.setitimer(signal.ITIMER_REAL, 0)
print(os.cpu_count(), len(os.sched_getaffinity(0)), os.getpid() > 0, os.urandom(2) != b"")
try:
    import numpy as np; print(float((np.ones((200, 200)) @ np.ones((200, 200)))[0, 0]))
except ImportError:
    print("no numpy")
print("python done")
"""
SHELL = r"""
set -e
mkdir -p s; cd s
echo hi > a.txt; cat a.txt; ls -la >/dev/null; grep -rn hi .; find . -name '*.txt' -exec cat {} \;
sed -n 1p a.txt; awk '{print $1}' a.txt; head -1 a.txt; tail -1 a.txt; wc -l a.txt; sort a.txt | uniq
cp a.txt b.txt; mv b.txt c.txt; touch d.txt; rm d.txt; diff a.txt c.txt; tar czf x.tgz a.txt; tar xzf x.tgz -O
gzip -k a.txt; ls | xargs echo; env >/dev/null; pwd >/dev/null; date >/dev/null; stat a.txt >/dev/null
du -sh . >/dev/null; chmod 600 a.txt; ln -s a.txt l; readlink l; tr a-z A-Z < a.txt; tee t.txt < a.txt >/dev/null
git init -q r --template=; cd r; echo x > f; git add f; git -c user.email=a@b -c user.name=a commit -qm m
git log --oneline >/dev/null; echo y >> f; git diff --stat; git status --short; cd ..
python3 -c 'print(1)'; sh -c 'echo $((1+2))'; bash -c 'sleep 0.01 & wait'
cd ..; rm -rf s; echo shell done
"""


def traced(argv, cwd) -> set:
    """Syscall names argv and its children made, from `strace -f`."""
    log = os.path.join(cwd, "..", "strace.log")
    subprocess.run(["strace", "-f", "-qq", "-o", log] + argv, cwd=cwd, check=True, capture_output=True, timeout=300)
    with open(log) as f:
        return {m.group(1) for m in re.finditer(r"^\d+ +([a-z0-9_]+)\(", f.read(), re.M)}


def how(name: str) -> str:
    """How the filter treats a call that is not plainly on the allowlist."""
    if name in seccomp.REFUSE:
        return f"refused ({os.strerror(seccomp.REFUSE[name])})"
    if name in seccomp.SELF_ONLY:
        return "allowed on the caller itself only (pid 0)"
    if name == "socketpair":
        return "allowed for AF_UNIX only"
    if name == "clone":
        return "allowed without namespace flags"
    return "refused (EPERM)"


def main():
    if not shutil.which("strace"):
        sys.exit("strace is not on PATH")
    used = set()
    for label, argv, script in (("python", [sys.executable, "-I", "-c"], PYTHON), ("shell", ["bash", "-c"], SHELL)):
        with tempfile.TemporaryDirectory() as top:
            work = os.path.join(top, "w")
            os.mkdir(work)
            calls = traced(argv + [script], work)
        used |= calls
        print(f"{label}: {len(calls)} distinct syscalls unconfined")
    print(f"allowlist: {len(seccomp.ALLOW)} names; used and not plainly allowed:")
    for name in sorted(used - set(seccomp.ALLOW)):
        print(f"  {name}: {how(name)}")
    for label, tool, script in (("python", "run_python", PYTHON), ("shell", "shell", SHELL)):
        with tempfile.TemporaryDirectory() as work:
            ws = Workspace(work, timeout=120, shell_allow=["bash"])
            out = ws.run_python(script) if tool == "run_python" else ws.shell("bash -c " + _quote(script))
            ok = f"{label} done" in out
            print(f"inside the sandbox, {label} workload: {'finished' if ok else 'FAILED'}")
            if not ok:
                print(out[-2000:])


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


if __name__ == "__main__":
    main()
