"""The sandbox launcher, run as `python -I -S confine.py CONFIG_JSON -- ARGV...` in a fresh
single-threaded process: join the call's cgroups, set rlimits, enter private mount and PID namespaces
(mountns.py), drop capabilities, apply Landlock and seccomp (Linux) or wrap in sandbox-exec (macOS),
then exec ARGV. Any failed step exits 126 with a
`justfit sandbox:` line: nothing runs half-confined.
"""

import ctypes
import json
import os
import resource
import sys

FAIL = 126
PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
LIMITS = {"AS": resource.RLIMIT_AS, "NPROC": getattr(resource, "RLIMIT_NPROC", None),
          "FSIZE": resource.RLIMIT_FSIZE, "CPU": resource.RLIMIT_CPU, "CORE": resource.RLIMIT_CORE,
          "NOFILE": resource.RLIMIT_NOFILE}


def fail(step: str, e) -> None:
    sys.stderr.write(f"justfit sandbox: {step} failed: {e}\n")
    sys.stderr.flush()
    os._exit(FAIL)


def join_cgroups(paths):
    for path in paths:
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))


def set_limits(limits: dict):
    for name, value in limits.items():
        if LIMITS.get(name) is not None and value is not None:
            resource.setrlimit(LIMITS[name], (int(value), int(value)))


def drop_capabilities():
    """Root keeps uid 0 but loses every capability, now and across exec (empty bounding set)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == 22:  # EINVAL: past the last cap
            break
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)
    data = (ctypes.c_uint32 * 6)()
    if libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def enter_namespaces(cfg: dict, ns: dict):
    """Enter the call's namespaces and fork its first process, which returns; the launcher stays on the
    host's filesystem, waits (killing the call at its timeout), copies the workspace changes back from
    the overlay's upper layer and exits with the call's exit code."""
    import copyback
    import mountns
    import seccomp

    tmp, ws = ns["tmp"], ns["cwd"]
    try:
        mountns.enter()
        host_tmp = mountns.stage(tmp, ns["ws_bytes"], ns["max_files"])
        options = copyback.mount_options(ws, os.path.join(tmp, "upper"), os.path.join(tmp, "work"), os.geteuid() != 0)
    except OSError as e:
        fail("entering mount and PID namespaces", e)
    pid = mountns.fork_child()
    if pid == 0:
        try:
            mountns.private_mounts()
            mountns.build(os.path.join(tmp, "root"), cfg["read"], cfg["write"], tmp, ns["tmp_bytes"], seccomp.arch(),
                          overlay=(ws, options), max_files=ns["max_files"])
            os.chdir(ws)
        except OSError as e:
            fail("building the private filesystem", e)
        return
    code, timed_out = mountns.supervise(pid, cfg["timeout"])
    if timed_out:
        os.close(os.open("timed-out", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=host_tmp))
    try:
        problems = copyback.apply(os.path.join(tmp, "upper"), ws)
    except OSError as e:
        problems = [str(e)]
    if problems:
        sys.stdout.write("\n[workspace: not every change was copied back: " + "; ".join(problems) + "]\n")
        sys.stdout.flush()
    os._exit(code)


def main(argv):
    cfg = json.loads(argv[1])
    cmd = argv[3:] if argv[2] == "--" else fail("arguments", "expected --")
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    if cfg.get("cgroups"):
        try:
            join_cgroups(cfg["cgroups"])
        except OSError as e:
            fail("joining the call's cgroups", e)
    if cfg["mode"] == "landlock":  # imported now: after pivot_root this folder is out of sight
        import copyback  # noqa: F401
        import landlock
        import mountns  # noqa: F401
        import seccomp
    ns = cfg.get("ns") if cfg["mode"] == "landlock" else None
    if ns:
        enter_namespaces(cfg, ns)  # returns in the child only, pid 1 of the call's namespace
    try:
        set_limits(cfg.get("limits", {}))
    except (OSError, ValueError) as e:
        fail("setrlimit", e)
    if cfg["mode"] == "seatbelt":
        cmd = ["/usr/bin/sandbox-exec", "-p", cfg["profile"], "--"] + cmd
    elif cfg["mode"] == "landlock":
        if os.geteuid() == 0 or ns:
            try:
                drop_capabilities()
            except OSError as e:
                fail("dropping capabilities", e)
        try:
            landlock.restrict(cfg["read"], cfg["write"], scoped_elsewhere=bool(ns))
        except OSError as e:
            fail("Landlock", e)
        try:
            seccomp.install()
        except OSError as e:
            fail("seccomp", e)
    elif cfg["mode"] != "none":
        fail("mode", cfg["mode"])
    try:
        os.execvp(cmd[0], cmd)
    except OSError as e:
        sys.stderr.write(f"{cmd[0]}: {e.strerror}\n")
        os._exit(127)


if __name__ == "__main__":
    main(sys.argv)
