"""The seccomp allowlist: the program's verdicts on both architectures (read by a small BPF interpreter,
so aarch64 is checked on any machine), calls the old deny list let through and the allowlist refuses,
and ordinary Python and shell work that must still run inside the sandbox."""

import errno
import struct
import subprocess
import sys

import pytest

from tests import agents_support  # noqa: F401
from justfit_agents import processes, seccomp, syscalls
from justfit_agents.sandbox import Workspace

MECH = processes.mechanism()
needs_landlock = pytest.mark.skipif(MECH.name != "landlock", reason=f"needs the Landlock + seccomp sandbox: {MECH.detail}")
ALLOW, EPERM = seccomp.RET_ALLOW, seccomp.RET_ERRNO | errno.EPERM
# calls the old deny list let through: (x86_64 nr, aarch64 nr, args); each succeeds unconfined
NOT_NEEDED = {"personality": (135, 92, "0xffffffff"), "sync": (162, 81, ""), "mlock": (149, 228, "buf, 4096"),
              "io_setup": (206, 0, "1, ctypes.byref(ctx)"), "seccomp": (317, 277, "2, 0, ctypes.byref(act)"),
              "landlock_create_ruleset": (444, 444, "None, 0, 1")}


def verdict(code: bytes, audit: int, nr: int, args=()) -> int:
    """Run a classic BPF seccomp program on one syscall (struct seccomp_data: nr, arch, ip, args[6])."""
    data = struct.pack("<iIQ6Q", nr, audit, 0, *(list(args) + [0] * (6 - len(args))))
    prog = [struct.unpack_from("<HBBI", code, i) for i in range(0, len(code), 8)]
    pc, acc = 0, 0
    while True:
        op, jt, jf, k = prog[pc]
        if op == seccomp.LD_W_ABS:
            acc = struct.unpack_from("<I", data, k)[0]
        elif op == seccomp.RET_K:
            return k
        elif op in (seccomp.JEQ_K, seccomp.JGE_K, seccomp.JSET_K):
            hit = {seccomp.JEQ_K: acc == k, seccomp.JGE_K: acc >= k, seccomp.JSET_K: bool(acc & k)}[op]
            pc += jt if hit else jf
        else:
            raise AssertionError(f"unexpected BPF op {op:#x}")
        pc += 1


@pytest.mark.parametrize("machine", sorted(seccomp.ARCHES))
def test_allowlist_verdicts(machine):
    audit, nr = seccomp.ARCHES[machine]
    code = seccomp.program(machine)
    allowed = set(seccomp.allowed(machine))
    assert len(code) // 8 < 4096 and allowed
    for n in range(seccomp.KNOWN_BELOW):  # every number inside the table: allowed iff named, or checked
        if n in {nr[name] for name in list(seccomp.SELF_ONLY) + list(seccomp.REFUSE) + ["socketpair", "clone"]}:
            continue
        assert verdict(code, audit, n) == (ALLOW if n in allowed else EPERM), (machine, n)
    for name, (x86, arm, _) in NOT_NEEDED.items():
        assert verdict(code, audit, x86 if machine == "x86_64" else arm) == EPERM, name
    assert verdict(code, audit, 470) == verdict(code, audit, 10**6) == seccomp.RET_ERRNO | errno.ENOSYS
    assert verdict(code, audit, nr["socket"], (1,)) == seccomp.RET_ERRNO | errno.EACCES
    assert verdict(code, audit, nr["socketpair"], (1,)) == ALLOW
    assert verdict(code, audit, nr["socketpair"], (2,)) == seccomp.RET_ERRNO | errno.EACCES
    assert verdict(code, audit, nr["clone"], (0x11,)) == ALLOW
    assert verdict(code, audit, nr["clone"], (0x10000000,)) == EPERM  # CLONE_NEWUSER
    assert verdict(code, audit, nr["prlimit64"], (0,)) == ALLOW
    assert verdict(code, audit, nr["prlimit64"], (7,)) == EPERM
    assert verdict(code, 0x40000003, nr["read"]) == seccomp.RET_KILL_PROCESS  # i386 ABI
    if machine == "x86_64":
        assert verdict(code, audit, 0x40000000 | nr["read"]) == EPERM  # x32 ABI


def test_every_allowed_name_has_a_number():
    names = {row.split()[0] for row in syscalls.TABLE.strip().splitlines()}
    assert set(seccomp.ALLOW) <= names and not set(NOT_NEEDED) & set(seccomp.ALLOW)
    assert len(seccomp.ALLOW) == len(set(seccomp.ALLOW))
    for machine in seccomp.ARCHES:
        nr = seccomp.ARCHES[machine][1]
        assert len(set(nr.values())) == len(nr), machine  # no number given twice


def _probe() -> str:
    col = 0 if seccomp.arch() == "x86_64" else 1
    lines = ["import ctypes", "libc = ctypes.CDLL(None, use_errno=True)",
             "buf, ctx, act = ctypes.create_string_buffer(4096), ctypes.c_uint64(0), ctypes.c_uint32(0x7FFF0000)",
             "libc.syscall.restype = ctypes.c_long"]
    for name, row in NOT_NEEDED.items():
        args = f", {row[2]}" if row[2] else ""
        lines.append(f"r = libc.syscall({row[col]}{args}); print({name!r}, r, ctypes.get_errno() if r < 0 else 0)")
    return "\n".join(lines) + "\n"


@needs_landlock
def test_calls_the_deny_list_let_through_are_refused(tmp_path):
    """personality, sync, mlock, io_setup, seccomp and landlock_create_ruleset all succeed unconfined (and
    did inside the deny-list filter); the allowlist refuses each with EPERM."""
    outside = subprocess.run([sys.executable, "-I", "-c", _probe()], capture_output=True, text=True, timeout=30).stdout
    rows = {line.split()[0]: line.split()[1:] for line in outside.splitlines()}
    assert set(rows) == set(NOT_NEEDED) and all(r[1] == "0" for r in rows.values()), outside
    inside = Workspace(tmp_path, timeout=20).run_python(_probe())
    rows = {line.split()[0]: line.split()[1:] for line in inside.splitlines() if line.strip()}
    assert rows == {name: ["-1", str(errno.EPERM)] for name in NOT_NEEDED}, inside


@needs_landlock
def test_python_work_runs_under_the_allowlist(tmp_path):
    code = ("import os, subprocess, sys, threading, sqlite3, mmap, shutil, multiprocessing as mp\n"
            "os.makedirs('d/e'); open('d/e/f', 'w').write('x' * 10); shutil.copy('d/e/f', 'd/g'); os.replace('d/g', 'd/h')\n"
            "with open('d/h', 'r+b') as f:\n    m = mmap.mmap(f.fileno(), 0); m[:1] = b'y'; m.close(); os.fsync(f.fileno())\n"
            "db = sqlite3.connect('d/x.db'); db.execute('create table t(a)'); db.commit(); db.close()\n"
            "done = []\nts = [threading.Thread(target=done.append, args=(i,)) for i in range(4)]\n"
            "[t.start() for t in ts]; [t.join() for t in ts]\n"
            "child = subprocess.run([sys.executable, '-c', 'print(6 * 7)'], capture_output=True, text=True).stdout.split()\n"
            "with mp.Pool(2) as p: pool = p.map(abs, [-1, -2])\n"
            "try:\n    import numpy; np = int((numpy.ones((64, 64)) @ numpy.ones((64, 64)))[0, 0])\n"
            "except ImportError:\n    np = 64\n"
            "print(open('d/h').read()[:2], sorted(os.listdir('d')), len(done), child, pool, np)\n")
    out = Workspace(tmp_path, timeout=60).run_python(code)
    assert out.strip() == "yx ['e', 'h', 'x.db'] 4 ['42'] [1, 2] 64", out


@needs_landlock
def test_shell_tools_run_under_the_allowlist(tmp_path):
    (tmp_path / "a.txt").write_text("hello\n")
    script = ("set -e; mkdir s; cp a.txt s/b.txt; grep -rn hello s; find s -name '*.txt' | xargs wc -l | head -1; "
              "sed 's/h/j/' a.txt | sort | uniq; tar czf s.tgz s; tar tzf s.tgz | head -1; ln -s a.txt l; readlink l; "
              "git init -q r --template=; cd r; git -c user.email=a@b -c user.name=a commit -q --allow-empty -m m; "
              "git log --format=%s; cd ..; python3 -c 'print(2 + 2)'; sleep 0.01 & wait; rm -r s r; echo done")
    out = Workspace(tmp_path, timeout=60, shell_allow=["bash"]).shell(f"bash -c \"{script}\"")
    assert out.split() == ["s/b.txt:1:hello", "1", "s/b.txt", "jello", "s/", "a.txt", "m", "4", "done"], out
