"""Run one tool process inside the OS sandbox: which mechanism this machine has (probed once), the
paths and limits it gets, the launcher command, and a timeout that kills the whole process group
(and pids cgroup) while keeping every byte of output the process wrote before it ended.
"""

import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import List, Optional

from . import landlock, seatbelt, seccomp

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "confine.py")
SYSTEM_READ = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache",
               "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives", "/etc/gitconfig",
               "/dev/urandom", "/dev/random", "/dev/zero")
DEVICE_WRITE = ("/dev/null",)


@dataclass
class Limits:
    """Per tool call: wall-clock timeout, address space, processes, bytes per file, output kept."""

    timeout: float = 10.0
    memory_bytes: int = 2 << 30
    processes: int = 64
    file_bytes: int = 256 << 20
    output_chars: int = 8000


@dataclass
class Mechanism:
    """The sandbox this machine gives tool processes: name ('landlock', 'seatbelt' or '') and why."""

    name: str
    detail: str
    pids_cgroup: bool = False
    notes: List[str] = field(default_factory=list)


def python_paths() -> List[str]:
    """Folders the Python interpreter needs to start and import its libraries (read-only)."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.realpath(sys.executable))}
    paths |= {os.path.realpath(p) for p in list(paths)}
    return sorted(p for p in paths if p and os.path.isdir(p))


def minimal_env(home: str, tmp: str) -> dict:
    """The only environment a tool process sees: no secrets of the parent, proxies pointed nowhere."""
    path = os.pathsep.join([os.path.dirname(sys.executable), "/usr/local/bin", "/usr/bin", "/bin"])
    return {"PATH": path, "HOME": home, "TMPDIR": tmp, "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8",
            "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1", "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9",
            "no_proxy": ""}


# -- pids cgroup: RLIMIT_NPROC does not bind root, a cgroup does ------------------------------------------
def _cgroup_parent() -> Optional[str]:
    """A writable pids-controller folder to create per-call cgroups in (cgroup v1 or v2), or None."""
    v1 = "/sys/fs/cgroup/pids"
    if os.path.isfile(os.path.join(v1, "cgroup.procs")) and os.access(v1, os.W_OK):
        return v1
    try:
        with open("/sys/fs/cgroup/cgroup.controllers") as f:
            if "pids" not in f.read().split():
                return None
        with open("/proc/self/cgroup") as f:
            rel = next(line.split("::", 1)[1].strip() for line in f if line.startswith("0::"))
    except (OSError, StopIteration):
        return None
    here = os.path.join("/sys/fs/cgroup", rel.lstrip("/"))
    return here if os.access(here, os.W_OK) else None


def make_cgroup(max_pids: int) -> Optional[str]:
    """A fresh pids cgroup capped at max_pids, or None when this machine offers none."""
    parent = _cgroup_parent()
    if parent is None:
        return None
    path = os.path.join(parent, f"justfit-tool-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        os.mkdir(path)
        with open(os.path.join(path, "pids.max"), "w") as f:
            f.write(str(max_pids))
        return path
    except OSError:
        remove_cgroup(path)
        return None


def cgroup_pids(path: str) -> List[int]:
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []


def remove_cgroup(path: str):
    """SIGKILL whatever is left in the cgroup, then remove it."""
    for _ in range(200):
        pids = cgroup_pids(path)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    try:
        os.rmdir(path)
    except OSError:
        pass


# -- mechanism ---------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def mechanism() -> Mechanism:
    """Probe once: can this machine confine a process? Landlock + seccomp on Linux, Seatbelt on macOS."""
    if seatbelt.available():
        return Mechanism("seatbelt", "macOS Seatbelt (sandbox-exec), generated profile, network denied")
    abi = landlock.abi()
    if abi < 1:
        return Mechanism("", "no Landlock in this kernel (Linux 5.13+ with Landlock enabled is needed)")
    if not seccomp.arch():
        return Mechanism("", f"no seccomp table for this machine ({os.uname().machine})")
    probe = Limits(timeout=20.0)
    tmp = tempfile.mkdtemp(prefix="justfit-probe-")
    try:
        out, rc, _ = run([sys.executable, "-I", "-S", "-c", "print('ok')"], tmp, probe, mode="landlock")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if rc != 0 or out.strip() != "ok":
        return Mechanism("", f"the Landlock/seccomp launcher failed here: {out.strip()[:200]}")
    root = os.geteuid() == 0
    cg = make_cgroup(8)
    if cg:
        remove_cgroup(cg)
    notes = []
    if root and not cg:
        notes.append("running as root without a writable pids cgroup: the process count is not bounded")
    net = "TCP denied by Landlock and seccomp" if abi >= 4 else "sockets denied by seccomp"
    detail = (f"Landlock ABI {abi} + seccomp ({seccomp.arch()}): files limited to the workspace, {net}, "
              f"rlimits, process group killed at the timeout" + (", pids cgroup" if cg else ""))
    return Mechanism("landlock", detail, bool(cg), notes)


def _config(mode: str, workspace: str, tmp: str, limits: Limits, cgroup: Optional[str],
            extra_read=()) -> dict:
    read = list(SYSTEM_READ) + python_paths() + list(extra_read)
    write = [workspace, tmp] + list(DEVICE_WRITE)
    nproc = limits.processes + (_processes_of_uid() if os.geteuid() != 0 else 0)
    cfg = {"mode": mode, "read": read, "write": write, "cgroup": cgroup,
           "limits": {"AS": limits.memory_bytes, "NPROC": nproc, "FSIZE": limits.file_bytes,
                      "CPU": int(limits.timeout) + 2, "CORE": 0}}
    if mode == "seatbelt":
        cfg["profile"] = seatbelt.profile(read, [workspace, tmp])
    return cfg


def _processes_of_uid() -> int:
    """RLIMIT_NPROC counts every process of the real uid, so the cap is set above what already runs."""
    uid, n = os.getuid(), 0
    for d in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if d.isdigit():
            try:
                n += os.stat(f"/proc/{d}").st_uid == uid
            except OSError:
                pass
    return n or 512


def run(argv: List[str], workspace: str, limits: Limits, mode: str, extra_read=()):
    """Run argv confined (mode 'landlock' | 'seatbelt' | 'none'); (output text, exit code or None when
    it timed out, chars written in all). The output keeps what was printed before any kill."""
    import json

    tmp = tempfile.mkdtemp(prefix="justfit-tool-")
    cgroup = make_cgroup(limits.processes) if mode == "landlock" and os.geteuid() == 0 else None
    cfg = _config(mode, str(workspace), tmp, limits, cgroup, extra_read)
    cmd = [sys.executable, "-I", "-S", LAUNCHER, json.dumps(cfg), "--"] + list(argv)
    try:
        p = subprocess.Popen(cmd, cwd=workspace, env=minimal_env(str(workspace), tmp), stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        reader = _Reader(p.stdout, limits.output_chars)
        rc = _wait_then_kill_group(p, limits.timeout)
        if cgroup:
            remove_cgroup(cgroup)
        reader.join()
        return reader.text(), rc, reader.total
    finally:
        if cgroup:
            remove_cgroup(cgroup)
        shutil.rmtree(tmp, ignore_errors=True)


def _wait_then_kill_group(p: subprocess.Popen, timeout: float) -> Optional[int]:
    """Wait for the main process (without reaping it, so its group id stays reserved), SIGKILL its whole
    process group whether it finished or timed out, then reap it. None when it timed out."""
    exited = True
    try:
        fd = os.pidfd_open(p.pid)
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        try:
            exited = bool(select.select([fd], [], [], timeout)[0])
        finally:
            os.close(fd)
    else:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            exited = False
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    rc = p.wait()
    return rc if exited else None


class _Reader(threading.Thread):
    """Drains a pipe to its end, keeping the first `keep` characters' worth of bytes."""

    def __init__(self, pipe, keep: int):
        super().__init__(daemon=True)
        self.pipe, self.keep, self.chunks, self.kept, self.total = pipe, keep * 4, [], 0, 0
        self.start()

    def run(self):
        while True:
            b = self.pipe.read1(65536)
            if not b:
                break
            self.total += len(b)
            if self.kept < self.keep:
                self.chunks.append(b[: self.keep - self.kept])
                self.kept += len(self.chunks[-1])
        self.pipe.close()

    def join(self, timeout=None):
        super().join(5.0 if timeout is None else timeout)

    def text(self) -> str:
        return b"".join(self.chunks).decode("utf-8", "replace")
