"""Linux Landlock through raw syscalls (ctypes): confine this process and its future children to a
few read-only and read-write folders, with TCP bind/connect and out-of-domain signals denied.

No relative imports: the launcher (confine.py) loads this file as a top-level module.
"""

import ctypes
import os
import platform

SYS_CREATE_RULESET, SYS_ADD_RULE, SYS_RESTRICT_SELF = 444, 445, 446  # same numbers on x86_64 and arm64
CREATE_RULESET_VERSION = 1
RULE_PATH_BENEATH = 1
PR_SET_NO_NEW_PRIVS = 38

# filesystem rights by the ABI that introduced them (landlock.h)
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
REMOVE_DIR, REMOVE_FILE, MAKE_CHAR, MAKE_DIR, MAKE_REG = 1 << 4, 1 << 5, 1 << 6, 1 << 7, 1 << 8
MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK, MAKE_SYM = 1 << 9, 1 << 10, 1 << 11, 1 << 12
REFER, TRUNCATE, IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
FS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}
FILE_ONLY = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV  # rights that apply to a file itself
NET_BIND_TCP, NET_CONNECT_TCP = 1, 2  # ABI 4
SCOPE_ABSTRACT_UNIX, SCOPE_SIGNAL = 1, 2  # ABI 6

SCOPED_ABI = 6
READ = EXECUTE | READ_FILE | READ_DIR
WRITE = (1 << 16) - 1  # everything, masked to the ABI


class LandlockError(OSError):
    """Landlock is missing or refused a step: the caller must not run anything unconfined."""


class _Attr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def abi() -> int:
    """The kernel's Landlock ABI version, 0 when Landlock is absent or disabled (or not Linux)."""
    if platform.system() != "Linux":
        return 0
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    v = libc.syscall(SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(CREATE_RULESET_VERSION))
    return max(int(v), 0)


def unscoped(version: int) -> str:
    """Why an ABI without scoping is refused, in one line."""
    return (f"Landlock ABI {version} has no scoping of signals and abstract unix sockets "
            f"(ABI {SCOPED_ABI}, Linux 6.12+, is needed unless PID and mount namespaces are available)")


def fs_mask(version: int) -> int:
    """Every filesystem right the given ABI knows."""
    return FS_BY_ABI[max(k for k in FS_BY_ABI if k <= version)]


def restrict(read_paths, write_paths, deny_tcp: bool = True, scope: bool = True, scoped_elsewhere: bool = False) -> int:
    """Confine the calling process: read (and execute) under read_paths, everything under write_paths,
    nothing elsewhere; TCP and signals to processes outside denied where the ABI allows. An ABI without
    scoping (below 6) is refused unless the caller confirms that another mechanism keeps signals and
    abstract unix sockets inside (scoped_elsewhere: a PID namespace and a seccomp filter without
    socket()). Returns the ABI used; LandlockError when any step fails (never a partial sandbox that
    looks whole)."""
    version = abi()
    if version < 1:
        raise LandlockError("Landlock is not available on this kernel")
    if scope and version < SCOPED_ABI and not scoped_elsewhere:
        raise LandlockError(unscoped(version))
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    mask = fs_mask(version)
    attr = _Attr(mask, NET_BIND_TCP | NET_CONNECT_TCP if deny_tcp and version >= 4 else 0,
                 SCOPE_ABSTRACT_UNIX | SCOPE_SIGNAL if scope and version >= 6 else 0)
    size = 24 if version >= 6 else 16 if version >= 4 else 8
    fd = libc.syscall(SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if fd < 0:
        raise LandlockError(ctypes.get_errno(), f"landlock_create_ruleset: {os.strerror(ctypes.get_errno())}")
    try:
        for paths, access in ((read_paths, READ), (write_paths, WRITE)):
            for p in paths:
                _add_path(libc, fd, p, access & mask)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise LandlockError(ctypes.get_errno(), "prctl(NO_NEW_PRIVS) failed")
        if libc.syscall(SYS_RESTRICT_SELF, ctypes.c_int(fd), ctypes.c_uint32(0)) != 0:
            raise LandlockError(ctypes.get_errno(), f"landlock_restrict_self: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)
    return version


def _add_path(libc, ruleset_fd: int, path: str, access: int):
    """One path-beneath rule; a path that does not exist is skipped (not every system has /lib64)."""
    try:
        pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if not os.path.isdir(path):
            access &= FILE_ONLY
        rule = _PathBeneath(access, pfd)
        if libc.syscall(SYS_ADD_RULE, ctypes.c_int(ruleset_fd), ctypes.c_int(RULE_PATH_BENEATH),
                        ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
            raise LandlockError(ctypes.get_errno(), f"landlock_add_rule {path}: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(pfd)
