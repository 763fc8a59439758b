"""One cgroup per tool call, so memory and processes are totals for the whole call (every fork and
child counted together), not per process: RLIMIT_AS binds one process and RLIMIT_NPROC does not bind
root. cgroup v2 (memory.max, pids.max) where this process's own cgroup is writable, else cgroup v1's
pids and memory hierarchies; None where neither is offered (the caller says so)."""

import os
import signal
import time
from typing import List, Optional

V1 = "/sys/fs/cgroup"


def _own(controller: str) -> Optional[str]:
    """This process's cgroup path for a v1 controller ('' for v2), from /proc/self/cgroup."""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, names, path = line.rstrip("\n").split(":", 2)
                if controller in names.split(","):
                    return path
    except (OSError, ValueError):
        pass
    return None


def _parents() -> List[tuple]:
    """(folder to create the call's cgroup in, {file: key}) per writable hierarchy with the controllers."""
    v2 = os.path.join(V1, "cgroup.controllers")
    if os.path.isfile(v2):
        try:
            with open(v2) as f:
                have = set(f.read().split())
        except OSError:
            have = set()
        here = os.path.join(V1, (_own("") or "/").lstrip("/"))
        if {"pids", "memory"} <= have and os.access(here, os.W_OK):
            return [(here, {"pids.max": "pids", "memory.max": "memory", "memory.swap.max": "swap"})]
        return []
    out = []
    for controller, files in (("pids", {"pids.max": "pids"}),
                              ("memory", {"memory.limit_in_bytes": "memory", "memory.memsw.limit_in_bytes": "memory"})):
        own = _own(controller)
        here = os.path.join(V1, controller, (own or "/").lstrip("/"))
        if own is not None and os.path.isfile(os.path.join(here, "cgroup.procs")) and os.access(here, os.W_OK):
            out.append((here, files))
    return out if len(out) == 2 else []


def make(max_pids: int, memory_bytes: int) -> Optional[List[str]]:
    """Fresh cgroups capping pids and memory (swap included where the kernel counts it), or None."""
    values = {"pids": str(max_pids), "memory": str(memory_bytes), "swap": "0"}
    made: List[str] = []
    tag = f"justfit-tool-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        parents = _parents()
        for parent, files in parents:
            path = os.path.join(parent, tag)
            os.mkdir(path)
            made.append(path)
            for name, key in files.items():
                if os.path.exists(os.path.join(path, name)):
                    with open(os.path.join(path, name), "w") as f:
                        f.write(values[key])
        return made or None
    except OSError:
        remove(made)
        return None


def pids(path: str) -> List[int]:
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []


def remove(paths):
    """SIGKILL whatever is left in the cgroups, then remove them."""
    for path in paths or ():
        for _ in range(200):
            left = pids(path)
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)
        try:
            os.rmdir(path)
        except OSError:
            pass
