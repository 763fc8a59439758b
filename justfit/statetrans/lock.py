"""One writer per session: `sessions/.locks/<name>.lock`, an flock held while a process has the
session open, holding the owner's pid for the error message. The kernel drops the flock when its
owner dies (even by kill -9), so a stale lock file is simply taken over. Within one process the lock
is counted: opening the same session twice there shares it.

A path can be deleted under its holder (`rm sessions/.locks/x.lock`), after which a second process
would lock a new file. So on Linux the holder also binds an abstract unix socket named after the
sessions folder (device, inode) and the session: it has no path to delete and the kernel frees it when
the holder exits. A holder re-creates its lock file when it finds it gone (at each commit).
"""

import errno
import fcntl
import hashlib
import os
import socket
import struct
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Optional, Tuple

from ..errors import UserError

_HELD: Dict[Tuple[str, str], list] = {}  # (lock path, name) -> [fd, count, socket or None]
_GUARD = threading.Lock()
_UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT)


class SessionInUse(UserError):
    """Another process has this session open."""


def lock_path(home: Path, name: str) -> Path:
    return Path(home) / "sessions" / ".locks" / f"{name}.lock"


def acquire(home: Path, name: str, count: bool = True, exclusive: bool = False) -> bool:
    """Take (or share, in this process) the session's lock; SessionInUse when another process holds it.
    count=False takes it only if this process does not hold it yet (a commit's safety net), and re-makes
    a held lock file that was deleted. exclusive=True refuses a lock this process holds too (eviction).
    Returns False when the lock folder cannot be written (read-only home: the session cannot be saved)."""
    path = lock_path(home, name)
    key = (str(path), name)
    with _GUARD:
        if key in _HELD:
            if exclusive:
                raise SessionInUse(f"session {name!r} is open in this process")
            _HELD[key][1] += count
            if not count:
                _HELD[key][0] = _keep_file(_HELD[key][0], path, name)
            return True
        try:
            fd = _lock_file(path, name)
        except OSError as e:
            if e.errno in _UNWRITABLE:
                return False
            raise
        try:
            sock = _claim(path.parent.parent, name)
        except BaseException:
            _drop(fd, path)
            raise
        _HELD[key] = [fd, 1, sock]
        return True


def release(home: Path, name: str):
    """Drop one hold of the session's lock; the last one removes the file and unlocks it."""
    path = lock_path(home, name)
    key = (str(path), name)
    with _GUARD:
        held = _HELD.get(key)
        if held is None:
            return
        held[1] -= 1
        if held[1] > 0:
            return
        del _HELD[key]
        if held[2] is not None:  # first: a process that gets the file next must find the name free
            held[2].close()
        _drop(held[0], path)


@contextmanager
def held_if_free(home: Path, name: str):
    """`with held_if_free(home, name) as free:` free is True, with the lock held for the block, when no
    process (this one included) has the session open; False otherwise (an eviction skips it)."""
    try:
        ok = acquire(home, name, exclusive=True)
    except SessionInUse:
        ok = None
    try:
        yield ok is not None
    finally:
        if ok:
            release(home, name)


def _drop(fd: int, path: Path):
    """Remove the lock file while still holding it (a waiter that opened the old file retries on the
    new one), then unlock."""
    try:
        if os.fstat(fd).st_ino == os.stat(path).st_ino:
            os.unlink(path)
    except OSError:
        pass
    os.close(fd)


def _keep_file(fd: int, path: Path, name: str) -> int:
    """The held fd, or a new one locking a re-made file when ours was deleted from the path."""
    try:
        if os.fstat(fd).st_ino == os.stat(path).st_ino:
            return fd
    except FileNotFoundError:
        pass
    except OSError:
        return fd
    try:
        new = _lock_file(path, name)
    except OSError:
        return fd  # cannot re-make it (read-only now): the socket (Linux) still guards the session
    os.close(fd)
    return new


def _claim(sessions: Path, name: str) -> Optional[socket.socket]:
    """Linux: a bound abstract unix socket unique to this sessions folder and session (SessionInUse
    when another process has it). None elsewhere, or where sockets are refused (flock alone then)."""
    if not sys.platform.startswith("linux"):
        return None
    st = os.stat(sessions)
    key = hashlib.sha256(f"{st.st_dev}:{st.st_ino}:{name}".encode()).hexdigest()[:48]
    address = f"\0justfit-session-{key}"
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError:  # sockets refused here (a sandbox): the flock alone guards the session
        return None
    try:
        sock.bind(address)
        sock.listen(1)  # lets a refused process ask the kernel who the holder is (SO_PEERCRED)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise _in_use(name, _peer_pid(address)) from None
        return None
    return sock


def _peer_pid(address: str) -> str:
    """The pid of the process that bound `address`, or '?'."""
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        c.settimeout(0.5)
        c.connect(address)
        pid, _, _ = struct.unpack("3i", c.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        return str(pid)
    except (OSError, AttributeError):
        return "?"
    finally:
        c.close()


def _in_use(name: str, owner: str) -> SessionInUse:
    return SessionInUse(f"session {name!r} is in use by process {owner}; close it there, or wait, "
                        "or use another session name")


def _lock_file(path: Path, name: str) -> int:
    """An fd holding an exclusive flock on the file now at `path`, with our pid written in it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(100):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "?"
            os.close(fd)
            raise _in_use(name, owner) from None
        except BaseException:
            os.close(fd)
            raise
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            except OSError:  # a full disk: the lock holds without the pid in it
                pass
            return fd
        os.close(fd)  # the owner removed the file as we opened it: lock the new one
    raise SessionInUse(f"session {name!r}: its lock file keeps changing; another process is opening and closing it")
