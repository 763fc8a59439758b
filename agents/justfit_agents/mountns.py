"""A private filesystem view for one tool call, built the way bubblewrap builds one: new mount, PID and
IPC namespaces (plus a user namespace when not root), an empty tmpfs root holding only read-only binds of
the system folders, read-write binds of the workspace and the devices it may write, and size-capped
private tmpfs folders for $TMPDIR and /dev/shm (POSIX semaphores: multiprocessing); then pivot_root
into it. Landlock decides what may be opened; this decides what
exists at all, so stat, inotify and directory listings outside the workspace find nothing. In the new
PID namespace no process outside the call has a pid the program could name.

No relative imports: the launcher (confine.py) loads this file as a top-level module.
"""

import ctypes
import os
import select
import signal

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID = 0x00020000, 0x08000000, 0x10000000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
MNT_DETACH, PR_SET_PDEATHSIG = 2, 1
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
SHM = "/dev/shm"


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    return libc


def _check(rc: int, what: str):
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _mount(libc, src, target, fstype, flags, data=None):
    enc = lambda s: s.encode() if isinstance(s, str) else s  # noqa: E731
    _check(libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def enter():
    """Unshare the mount, PID and IPC namespaces (SysV IPC and POSIX message queues are not files, so
    Landlock does not see them), and a user namespace mapping this uid when not root; the launcher's
    children start in them."""
    libc = _libc()
    uid, gid = os.geteuid(), os.getegid()
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | (0 if uid == 0 else CLONE_NEWUSER)
    _check(libc.unshare(flags), "unshare")
    if uid != 0:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)


def stage(tmp: str, ws_bytes: int, max_files: int) -> int:
    """In the launcher's own mount namespace: a tmpfs of ws_bytes and max_files inodes over tmp that will
    hold the new root and the workspace overlay's upper layer. Returns an fd of the host's tmp folder (for the timeout mark)."""
    libc = _libc()
    host = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here propagates back out
    _mount(libc, "tmpfs", tmp, "tmpfs", MS_NOSUID | MS_NODEV, f"size={int(ws_bytes)},nr_inodes={int(max_files)},mode=700")
    for sub in ("root", "upper", "work"):
        os.mkdir(os.path.join(tmp, sub), 0o700)
    return host


def fork_child() -> int:
    """Fork the namespace's first process (pid 1 inside; it dies with the launcher); 0 in the child."""
    pid = os.fork()
    if pid == 0:
        _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    return pid


def supervise(pid: int, timeout: float):
    """Wait up to timeout for the child, SIGKILL it (and with it its whole PID namespace) after that;
    (exit code as a shell reports it, timed out?)."""
    timed_out = False
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        timed_out = not select.select([fd], [], [], timeout)[0]
        os.close(fd)
    if timed_out:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return (os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)), timed_out


def private_mounts():
    """A mount namespace of the child's own (unshared from the launcher's), so its pivot_root leaves the
    launcher on the host's root."""
    _check(_libc().unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")


def _place(root: str, path: str, is_dir: bool) -> str:
    """Create the mount point for `path` under root (a folder or an empty file); return it."""
    target = root + path
    if is_dir:
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not os.path.exists(target):
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o600))
    return target


def _bind(libc, root: str, path: str, writable: bool):
    """Bind `path` at the same place under root (read-only unless writable); a symlink is copied as a
    symlink; a path that does not exist is skipped (not every system has /lib64)."""
    if os.path.islink(path):
        target = root + path
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not os.path.lexists(target):
            os.symlink(os.readlink(path), target)
        return
    if not os.path.exists(path):
        return
    target = _place(root, path, os.path.isdir(path))
    _mount(libc, path, target, None, MS_BIND | MS_REC)
    flags = MS_BIND | MS_REMOUNT | MS_NOSUID | (0 if writable else MS_RDONLY)
    _mount(libc, None, target, None, flags)


def build(root: str, read_paths, write_paths, tmp: str, tmp_bytes: int, machine: str, overlay=None,
          shm: str = SHM, max_files: int = 100_000):
    """Make root the filesystem of this process: only the listed paths exist there, $TMPDIR (tmp) and
    shm are fresh tmpfs folders of tmp_bytes and max_files inodes each (never the host's), and overlay = (path, options)
    mounts the workspace as an overlay instead of a bind; then pivot_root and forget the old root."""
    libc = _libc()
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    _mount(libc, "tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=755")
    for p in sorted(read_paths, key=len):
        _bind(libc, root, p, writable=False)
    skip = {tmp, shm} | ({overlay[0]} if overlay else set())
    for p in sorted(set(write_paths) - skip, key=len):
        _bind(libc, root, p, writable=True)
    if overlay:
        _mount(libc, "overlay", _place(root, overlay[0], True), "overlay", MS_NOSUID, overlay[1])
    for p, mode in ((tmp, "700"), (shm, "1777")):
        _mount(libc, "tmpfs", _place(root, p, True), "tmpfs", MS_NOSUID | MS_NODEV, f"size={int(tmp_bytes)},nr_inodes={int(max_files)},mode={mode}")
    _mount(libc, None, root, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(root)
    libc.syscall.restype = ctypes.c_long
    _check(libc.syscall(SYS_PIVOT_ROOT[machine], b".", b"."), "pivot_root")
    _check(libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")
