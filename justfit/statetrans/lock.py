"""One writer per session: `sessions/.locks/<name>.lock`, an flock held while a process has the
session open, holding the owner's pid for the error message. The kernel drops the flock when its
owner dies (even by kill -9), so a stale lock file is simply taken over. Within one process the lock
is counted: opening the same session twice there shares it.
"""

import errno
import fcntl
import os
import threading
from pathlib import Path
from typing import Dict, Tuple

from ..errors import UserError

_HELD: Dict[Tuple[str, str], list] = {}  # (lock path, name) -> [fd, count]
_GUARD = threading.Lock()


class SessionInUse(UserError):
    """Another process has this session open."""


def lock_path(home: Path, name: str) -> Path:
    return Path(home) / "sessions" / ".locks" / f"{name}.lock"


def acquire(home: Path, name: str, count: bool = True) -> bool:
    """Take (or share, in this process) the session's lock; SessionInUse when another process holds it.
    count=False takes it only if this process does not hold it yet (a commit's safety net). Returns
    False when the lock folder cannot be written (read-only home: the session cannot be saved anyway)."""
    path = lock_path(home, name)
    key = (str(path), name)
    with _GUARD:
        if key in _HELD:
            _HELD[key][1] += count
            return True
        try:
            fd = _lock_file(path, name)
        except OSError as e:
            if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT):
                return False
            raise
        _HELD[key] = [fd, 1]
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
        try:
            os.unlink(path)  # while still locked: a waiter that opened the old file retries on the new one
        except OSError:
            pass
        os.close(held[0])


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
            raise SessionInUse(f"session {name!r} is in use by process {owner}; close it there, or wait, "
                               "or use another session name") from None
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
