"""Run one tool process inside the OS sandbox: which mechanism this machine has (probed once), the
paths and limits it gets, the launcher command, and a timeout that kills the whole process group
(and the call's cgroups) while keeping every byte of output the process wrote before it ended.
"""

import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from functools import lru_cache
from typing import List, Optional

from . import cgroups, landlock, mountns, seatbelt, seccomp
from .trees import remove_tree

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "confine.py")
SYSTEM_READ = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache",
               "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives", "/etc/gitconfig",
               "/dev/urandom", "/dev/random", "/dev/zero")
DEVICE_WRITE = ("/dev/null",)
COPYBACK_SECONDS = 30.0  # after a call's timeout, for the launcher to copy the workspace changes back


@dataclass
class Limits:
    """Per tool call: wall-clock timeout, memory (per process, and in total where a cgroup is offered),
    processes, bytes per file, bytes in $TMPDIR in total (a size-capped tmpfs), bytes the call may
    write into the workspace in total (its overlay's upper layer, Linux), files it may create in each
    of those (inodes: a call cannot fill memory or the copy-back with empty files), output kept."""

    timeout: float = 10.0
    memory_bytes: int = 2 << 30
    processes: int = 64
    file_bytes: int = 256 << 20
    output_chars: int = 8000
    disk_bytes: int = 256 << 20
    workspace_bytes: int = 512 << 20
    files: int = 100_000


@dataclass
class Mechanism:
    """The sandbox this machine gives tool processes: name ('landlock', 'seatbelt' or '') and why."""

    name: str
    detail: str
    cgroup: bool = False
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
        out, rc, _ = run([sys.executable, "-I", "-S", "-c", "import os; print('ok', os.getpid())"], tmp, probe,
                         mode="landlock")
    finally:
        remove_tree(tmp)
    if rc != 0 or out.strip() != "ok 1":
        why = out.strip()[:200] or f"exit code {rc}"
        if abi < landlock.SCOPED_ABI:  # without namespaces nothing else keeps signals inside
            return Mechanism("", landlock.unscoped(abi) + f"; namespaces failed here: {why}")
        return Mechanism("", f"the Landlock/seccomp/namespace launcher failed here: {why}")
    cg = cgroups.make(8, 64 << 20)
    cgroups.remove(cg)
    notes = []
    if not cg:
        notes.append("no writable cgroup: memory is capped per process and processes by RLIMIT_NPROC only"
                     + (" (which does not bind root)" if os.geteuid() == 0 else ""))
    net = "TCP denied by Landlock and seccomp" if abi >= 4 else "sockets denied by seccomp"
    detail = (f"Landlock ABI {abi} + seccomp ({seccomp.arch()}) + mount/PID/IPC namespaces: only the workspace and "
              f"read-only system folders exist, {net}, rlimits, size-capped $TMPDIR and workspace writes (an overlay "
              f"copied back after the call), process group killed at "
              f"the timeout" + (", memory and pids cgroup per call" if cg else ""))
    return Mechanism("landlock", detail, bool(cg), notes)


def _config(mode: str, workspace: str, tmp: str, limits: Limits, cgroup_paths: Optional[List[str]],
            extra_read=()) -> dict:
    read = list(SYSTEM_READ) + python_paths() + list(extra_read)
    write = [workspace, tmp] + list(DEVICE_WRITE)
    nproc = limits.processes + (_processes_of_uid() if os.geteuid() != 0 else 0)
    cfg = {"mode": mode, "read": read, "write": write, "cgroups": cgroup_paths or [],
           "limits": {"AS": limits.memory_bytes, "NPROC": nproc, "FSIZE": limits.file_bytes,
                      "CPU": int(limits.timeout) + 2, "CORE": 0}}
    if mode == "landlock":  # the launcher stages the call on a tmpfs over tmp; $TMPDIR is a tmpfs at the same path
        cfg["ns"] = {"tmp": tmp, "tmp_bytes": limits.disk_bytes, "ws_bytes": limits.workspace_bytes,
                     "max_files": limits.files, "cwd": workspace}
        cfg["timeout"] = limits.timeout
        write.append(mountns.SHM)  # a private tmpfs there, never the host's
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


def run(argv: List[str], workspace: str, limits: Limits, mode: str, extra_read=(), need_cgroup: bool = False):
    """Run argv confined (mode 'landlock' | 'seatbelt' | 'none'); (output text, exit code or None when
    it timed out, chars written in all). The output keeps what was printed before any kill. need_cgroup:
    refuse (exit 126, a `justfit sandbox:` line) rather than run without the call's cgroup."""
    import json

    cgroup = cgroups.make(limits.processes, limits.memory_bytes) if mode == "landlock" else None
    if need_cgroup and not cgroup:
        return "justfit sandbox: making the call's memory and pids cgroup failed\n", 126, 0
    tmp = None
    try:
        tmp = tempfile.mkdtemp(prefix="justfit-tool-")
        cfg = _config(mode, str(workspace), tmp, limits, cgroup, extra_read)
        cmd = [sys.executable, "-I", "-S", LAUNCHER, json.dumps(cfg), "--"] + list(argv)
        p = subprocess.Popen(cmd, cwd=workspace, env=minimal_env(str(workspace), tmp), stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        reader = _Reader(p.stdout, limits.output_chars)
        grace = COPYBACK_SECONDS if "ns" in cfg else 0.0  # the launcher times the call out itself, then copies back
        rc = _wait_then_kill_group(p, limits.timeout + grace)
        if os.path.exists(os.path.join(tmp, "timed-out")):
            rc = None
        cgroups.remove(cgroup)  # anything left in it dies before we wait for the pipe to close
        cgroup = None
        reader.join()
        return reader.text(), rc, reader.total
    finally:
        cgroups.remove(cgroup)
        if tmp:
            remove_tree(tmp)


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
