"""A seccomp-BPF allowlist built with ctypes: a tool process may make only the syscalls that Python and
the shell tools need (ALLOW, by purpose); every other call fails with EPERM, and calls numbered past the
reviewed table (KNOWN_BELOW: newer than Linux 6.14) with ENOSYS, so libc falls back as on an older
kernel and a new kernel's new calls stay closed until reviewed. A few allowed calls have their arguments
checked: `socketpair` only for AF_UNIX (no `socket()` at all: EACCES), `clone` only without namespace
flags (`clone3` hides its flags in memory: ENOSYS, libc falls back to `clone`), and the calls that act
on a process by pid (rlimits, priority, CPU affinity, scheduling, memory policy) only on the caller
itself (pid 0). A foreign syscall ABI (another audit arch, x86_64's x32) never reaches the table.

The list was derived by tracing the tools' workloads (benchmarks/repro/seccomp_inventory.py) and then
widened by purpose only with calls that act on the caller's own memory, files, time and signals.
The launcher (confine.py) loads this file as a top-level module, so the table import works both ways.
"""

import ctypes
import errno
import platform
import struct

try:
    from . import syscalls
except ImportError:  # loaded by the launcher as a top-level module
    import syscalls

PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
RET_KILL_PROCESS, RET_ALLOW, RET_ERRNO = 0x80000000, 0x7FFF0000, 0x00050000
LD_W_ABS, JEQ_K, JGE_K, JSET_K, RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
AF_UNIX = 1
KNOWN_BELOW = 467  # x86_64 and aarch64 share numbers from 424 on; 467+ (open_tree_attr, file_getattr, ...) unreviewed
CLONE_NS = 0x00020000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x02000000
#          NEWNS        NEWUTS       NEWIPC       NEWUSER      NEWPID       NEWNET       NEWCGROUP

ALLOW = (
    # files: data, descriptors, sync of the caller's own files (not `sync`/`syncfs`: every disk of the host)
    "read write readv writev pread64 pwrite64 preadv pwritev preadv2 pwritev2 open openat openat2 creat close "
    "close_range lseek dup dup2 dup3 fcntl flock fsync fdatasync sync_file_range ftruncate truncate fallocate "
    "fadvise64 readahead sendfile copy_file_range splice tee "
    # names and metadata (Landlock and the private mount namespace decide what exists); xattrs read-only
    "stat fstat lstat newfstatat statx statfs fstatfs access faccessat faccessat2 readlink readlinkat getdents "
    "getdents64 getcwd chdir fchdir mkdir mkdirat rmdir unlink unlinkat rename renameat renameat2 link linkat "
    "symlink symlinkat chmod fchmod fchmodat fchmodat2 chown fchown fchownat lchown utime utimes futimesat "
    "utimensat umask mknod mknodat getxattr lgetxattr fgetxattr listxattr llistxattr flistxattr inotify_init "
    "inotify_init1 inotify_add_watch inotify_rm_watch "
    # the caller's own memory
    "brk mmap munmap mremap mprotect madvise mincore msync membarrier mbind get_mempolicy set_mempolicy "
    "memfd_create pkey_alloc pkey_free pkey_mprotect mseal map_shadow_stack "
    # processes and threads (the PID namespace and Landlock's scoping keep pids and signals inside the call)
    "fork vfork execve execveat exit exit_group wait4 waitid kill tkill tgkill rt_sigqueueinfo rt_tgsigqueueinfo "
    "pidfd_open pidfd_send_signal getpid getppid gettid getpgid getpgrp getsid getuid geteuid getgid getegid "
    "getgroups getresuid getresgid capget prctl arch_prctl set_tid_address set_robust_list rseq futex futex_waitv "
    "futex_wake futex_wait futex_requeue sched_yield sched_getaffinity sched_getparam sched_getscheduler "
    "sched_get_priority_max sched_get_priority_min sched_rr_get_interval sched_getattr getpriority ioprio_get "
    "getcpu getrusage times sysinfo uname getrlimit setrlimit "
    # time and timers (reading clocks; setting them needs capabilities the call does not have)
    "clock_gettime clock_getres clock_nanosleep nanosleep gettimeofday time timer_create timer_settime "
    "timer_gettime timer_getoverrun timer_delete timerfd_create timerfd_settime timerfd_gettime alarm getitimer "
    "setitimer "
    # signals to the caller's own handlers
    "rt_sigaction rt_sigprocmask rt_sigreturn rt_sigpending rt_sigtimedwait rt_sigsuspend sigaltstack signalfd "
    "signalfd4 pause restart_syscall "
    # waiting on descriptors, terminal-less ioctls, randomness
    "pipe pipe2 eventfd eventfd2 epoll_create epoll_create1 epoll_ctl epoll_wait epoll_pwait epoll_pwait2 poll "
    "ppoll select pselect6 ioctl getrandom "
    # data on the AF_UNIX pairs socketpair makes (no connect/bind/listen/accept: no socket can name a peer)
    "sendto recvfrom sendmsg recvmsg sendmmsg recvmmsg shutdown getsockname getpeername getsockopt setsockopt "
    # System V IPC, private to the call's IPC namespace
    "shmget shmat shmdt shmctl semget semop semtimedop semctl msgget msgsnd msgrcv msgctl"
).split()
REFUSE = {"socket": errno.EACCES, "clone3": errno.ENOSYS}  # refused with their own errno (why: module doc)
# calls allowed only when their pid argument (by index; the kernel reads an int) is 0, the caller itself
SELF_ONLY = {"prlimit64": 0, "setpriority": 1, "sched_setparam": 0, "sched_setscheduler": 0,
             "sched_setaffinity": 0, "sched_setattr": 0, "ioprio_set": 1, "migrate_pages": 0, "move_pages": 0,
             "get_robust_list": 0}
# syscall numbers per architecture: (audit arch, {name: nr})
ARCHES = {"x86_64": (0xC000003E, syscalls.numbers("x86_64")), "aarch64": (0xC00000B7, syscalls.numbers("aarch64"))}


class SeccompError(OSError):
    """The filter could not be installed: the caller must not run anything unconfined."""


def _ins(code, k, jt=0, jf=0) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def arch() -> str:
    """This machine's architecture name in ARCHES, or '' when the filter has no table for it."""
    m = platform.machine().lower()
    m = {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)
    return m if m in ARCHES and platform.system() == "Linux" else ""


def allowed(machine: str) -> list:
    """The sorted syscall numbers ALLOW names on one architecture (a call it lacks is skipped; a name
    the table does not know is an error, so a typo cannot silently drop or add a call)."""
    nr = ARCHES[machine][1]
    known = set().union(*(table for _, table in ARCHES.values()))
    unknown = [n for n in ALLOW if n not in known]
    if unknown:
        raise ValueError(f"seccomp: no syscall number for {', '.join(unknown)}")
    return sorted({nr[n] for n in ALLOW if n in nr})


def _ranges(numbers: list) -> list:
    """Consecutive numbers merged into (first, last) ranges, ascending."""
    out = []
    for n in numbers:
        if out and n == out[-1][1] + 1:
            out[-1] = (out[-1][0], n)
        else:
            out.append((n, n))
    return out


def program(machine: str = None) -> bytes:
    """The BPF program (struct sock_filter[]) for one architecture, as bytes."""
    machine = machine or arch()
    audit, nr = ARCHES[machine]
    deny = lambda e: RET_ERRNO | e  # noqa: E731
    p = [_ins(LD_W_ABS, 4), _ins(JEQ_K, audit, 1, 0), _ins(RET_K, RET_KILL_PROCESS), _ins(LD_W_ABS, 0)]
    if audit == ARCHES["x86_64"][0]:  # x32 syscalls share the arch value: refuse them all
        p += [_ins(JGE_K, 0x40000000, 0, 1), _ins(RET_K, deny(errno.EPERM))]
    p += [_ins(JGE_K, KNOWN_BELOW, 0, 1), _ins(RET_K, deny(errno.ENOSYS))]  # past the reviewed table
    for name, err in REFUSE.items():
        p += [_ins(JEQ_K, nr[name], 0, 1), _ins(RET_K, deny(err))]
    # socketpair only for AF_UNIX (connected pairs reach nothing outside)
    p += [_ins(JEQ_K, nr["socketpair"], 0, 4), _ins(LD_W_ABS, 16), _ins(JEQ_K, AF_UNIX, 0, 1),
          _ins(RET_K, RET_ALLOW), _ins(RET_K, deny(errno.EACCES))]
    for name, arg in SELF_ONLY.items():  # pid != 0: another process, refused
        p += [_ins(JEQ_K, nr[name], 0, 4), _ins(LD_W_ABS, 16 + 8 * arg), _ins(JEQ_K, 0, 0, 1),
              _ins(RET_K, RET_ALLOW), _ins(RET_K, deny(errno.EPERM))]
    # clone without namespace flags
    p += [_ins(JEQ_K, nr["clone"], 0, 4), _ins(LD_W_ABS, 16), _ins(JSET_K, CLONE_NS, 0, 1),
          _ins(RET_K, deny(errno.EPERM)), _ins(RET_K, RET_ALLOW)]
    # the allowlist as ascending ranges: past this range's end -> the next range; inside -> allow; before
    # its start -> no later range can hold it either -> deny
    for first, last in _ranges(allowed(machine)):
        p += [_ins(JGE_K, last + 1, 3, 0), _ins(JGE_K, first, 0, 1), _ins(RET_K, RET_ALLOW),
              _ins(RET_K, deny(errno.EPERM))]
    p += [_ins(RET_K, deny(errno.EPERM))]
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
