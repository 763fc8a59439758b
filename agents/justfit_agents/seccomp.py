"""A seccomp-BPF filter built with ctypes: no sockets, no ptrace, no mounts or namespaces, no leaving
the process group, no kernel-module/keyring/bpf/io_uring/fanotify calls, and the calls that act on
another process by pid (rlimits, priority, CPU affinity, scheduling, memory policy) only on the caller
itself (pid 0): a sandboxed program cannot lower the limits of the agent that launched it. Syscalls
numbered past the reviewed table (KNOWN_BELOW: calls added after Linux 6.14's removexattrat) are
refused with ENOSYS, so a newer kernel's new calls stay closed until reviewed; libc falls back on ENOSYS. Denied calls fail with an errno (the
program sees EPERM/EACCES and can say so); a foreign syscall ABI kills the process.

No relative imports: the launcher (confine.py) loads this file as a top-level module.
"""

import ctypes
import errno
import platform
import struct

PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
RET_KILL_PROCESS, RET_ALLOW, RET_ERRNO = 0x80000000, 0x7FFF0000, 0x00050000
LD_W_ABS, JEQ_K, JGE_K, JSET_K, RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
AF_UNIX = 1
KNOWN_BELOW = 467  # x86_64 and aarch64 share numbers from 424 on; 467+ (open_tree_attr, file_getattr, ...) unreviewed
CLONE_NS = 0x00020000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x02000000
#          NEWNS        NEWUTS       NEWIPC       NEWUSER      NEWPID       NEWNET       NEWCGROUP

# syscall numbers per architecture: (audit arch, {name: nr})
ARCHES = {
    "x86_64": (0xC000003E, dict(
        socket=41, socketpair=53, clone=56, clone3=435, ptrace=101, process_vm_readv=310, process_vm_writev=311,
        mount=165, umount2=166, pivot_root=155, chroot=161, unshare=272, setns=308, setsid=112, setpgid=109,
        io_uring_setup=425, io_uring_enter=426, io_uring_register=427, bpf=321, perf_event_open=298,
        keyctl=250, add_key=248, request_key=249, kexec_load=246, kexec_file_load=320, init_module=175,
        finit_module=313, delete_module=176, reboot=169, swapon=167, swapoff=168, acct=163, syslog=103,
        userfaultfd=323, open_by_handle_at=304, pidfd_getfd=438, kcmp=312, iopl=172, ioperm=173,
        open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433, mount_setattr=442,
        prlimit64=302, setpriority=141, sched_setparam=142, sched_setscheduler=144, sched_setaffinity=203,
        sched_setattr=314, ioprio_set=251, migrate_pages=256, move_pages=279, get_robust_list=274,
        process_madvise=440, process_mrelease=448, fanotify_init=300)),
    "aarch64": (0xC00000B7, dict(
        socket=198, socketpair=199, clone=220, clone3=435, ptrace=117, process_vm_readv=270, process_vm_writev=271,
        mount=40, umount2=39, pivot_root=41, chroot=51, unshare=97, setns=268, setsid=157, setpgid=154,
        io_uring_setup=425, io_uring_enter=426, io_uring_register=427, bpf=280, perf_event_open=241,
        keyctl=219, add_key=217, request_key=218, kexec_load=104, kexec_file_load=294, init_module=105,
        finit_module=273, delete_module=106, reboot=142, swapon=224, swapoff=225, acct=89, syslog=116,
        userfaultfd=282, open_by_handle_at=265, pidfd_getfd=438, kcmp=272,
        open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433, mount_setattr=442,
        prlimit64=261, setpriority=140, sched_setparam=118, sched_setscheduler=119, sched_setaffinity=122,
        sched_setattr=274, ioprio_set=30, migrate_pages=238, move_pages=239, get_robust_list=100,
        process_madvise=440, process_mrelease=448, fanotify_init=262)),
}
DENY_EPERM = ("ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root", "chroot",
              "unshare", "setns", "setsid", "setpgid", "io_uring_setup", "io_uring_enter", "io_uring_register",
              "bpf", "perf_event_open", "keyctl", "add_key", "request_key", "kexec_load", "kexec_file_load",
              "init_module", "finit_module", "delete_module", "reboot", "swapon", "swapoff", "acct", "syslog",
              "userfaultfd", "open_by_handle_at", "pidfd_getfd", "kcmp", "iopl", "ioperm", "open_tree",
              "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "process_madvise",
              "process_mrelease", "fanotify_init")
# calls allowed only when their pid argument (by index; the kernel reads an int) is 0, the caller itself
SELF_ONLY = {"prlimit64": 0, "setpriority": 1, "sched_setparam": 0, "sched_setscheduler": 0,
             "sched_setaffinity": 0, "sched_setattr": 0, "ioprio_set": 1, "migrate_pages": 0, "move_pages": 0,
             "get_robust_list": 0}


class SeccompError(OSError):
    """The filter could not be installed: the caller must not run anything unconfined."""


def _ins(code, k, jt=0, jf=0) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def arch() -> str:
    """This machine's architecture name in ARCHES, or '' when the filter has no table for it."""
    m = platform.machine().lower()
    m = {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)
    return m if m in ARCHES and platform.system() == "Linux" else ""


def program(machine: str = None) -> bytes:
    """The BPF program (struct sock_filter[]) for one architecture, as bytes."""
    audit, nr = ARCHES[machine or arch()]
    deny = lambda e: RET_ERRNO | e  # noqa: E731
    p = [_ins(LD_W_ABS, 4), _ins(JEQ_K, audit, 1, 0), _ins(RET_K, RET_KILL_PROCESS), _ins(LD_W_ABS, 0)]
    if audit == ARCHES["x86_64"][0]:  # x32 syscalls share the arch value: refuse them all
        p += [_ins(JGE_K, 0x40000000, 0, 1), _ins(RET_K, deny(errno.EPERM))]
    p += [_ins(JGE_K, KNOWN_BELOW, 0, 1), _ins(RET_K, deny(errno.ENOSYS))]  # deny by default past the table
    for name in DENY_EPERM:
        if name in nr:
            p += [_ins(JEQ_K, nr[name], 0, 1), _ins(RET_K, deny(errno.EPERM))]
    p += [_ins(JEQ_K, nr["socket"], 0, 1), _ins(RET_K, deny(errno.EACCES))]  # no socket(), any family
    p += [_ins(JEQ_K, nr["clone3"], 0, 1), _ins(RET_K, deny(errno.ENOSYS))]  # flags hidden in memory: libc falls back to clone
    # socketpair only for AF_UNIX (connected pairs reach nothing outside); clone without namespace flags
    p += [_ins(JEQ_K, nr["socketpair"], 0, 4), _ins(LD_W_ABS, 16), _ins(JEQ_K, AF_UNIX, 0, 1),
          _ins(RET_K, RET_ALLOW), _ins(RET_K, deny(errno.EACCES))]
    for name, arg in SELF_ONLY.items():  # pid != 0: another process, refused
        p += [_ins(JEQ_K, nr[name], 0, 4), _ins(LD_W_ABS, 16 + 8 * arg), _ins(JEQ_K, 0, 0, 1),
              _ins(RET_K, RET_ALLOW), _ins(RET_K, deny(errno.EPERM))]
    p += [_ins(JEQ_K, nr["clone"], 0, 3), _ins(LD_W_ABS, 16), _ins(JSET_K, CLONE_NS, 0, 1),
          _ins(RET_K, deny(errno.EPERM))]
    p += [_ins(RET_K, RET_ALLOW)]
    return b"".join(p)


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install():
    """Install the filter on the calling thread (inherited by children); SeccompError on failure."""
    if not arch():
        raise SeccompError(f"no seccomp table for {platform.system()} {platform.machine()}")
    code = program()
    buf = ctypes.create_string_buffer(code, len(code))
    prog = _Prog(len(code) // 8, ctypes.cast(buf, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise SeccompError(ctypes.get_errno(), "prctl(NO_NEW_PRIVS) failed")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise SeccompError(ctypes.get_errno(), "prctl(SECCOMP_MODE_FILTER) failed")
