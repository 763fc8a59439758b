"""Built-in tools confined to a workspace folder: files, search, Python and an opt-in shell.

File tools never follow a path the kernel has not checked: every component is opened with
O_NOFOLLOW relative to the folder fd before it (an openat walk), a symlink is read and followed only
when its target stays inside, hard-linked files are refused and writes are size-capped and atomic.
Code tools (run_python, shell) run inside the OS sandbox of processes.py (Landlock + seccomp on
Linux, Seatbelt on macOS): that is the wall. The shell allowlist is a convenience, not a defence.
Without a sandbox the code tools are disabled unless the user passes unsafe_no_sandbox=True.
"""

import dataclasses
import errno
import os
import re
import shlex
import stat
import sys
import time
from pathlib import Path
from typing import List, Optional

import regex

from . import processes, trees
from .tools import Tool, as_tool

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_LINKS = 40


class SandboxError(Exception):
    """A request the sandbox refuses; its text is returned to the model as the tool result."""


def describe(unsafe_no_sandbox: bool = False) -> str:
    """One line for `justfit info`: the sandbox code tools run in here, or why they are disabled."""
    m = processes.mechanism()
    if m.name:
        return m.detail + "".join(f" ({n})" for n in m.notes)
    if unsafe_no_sandbox:
        return f"NONE (unsafe_no_sandbox): {m.detail}"
    return f"none: {m.detail}; code tools are disabled (--unsafe-no-sandbox runs them unconfined)"


class Workspace:
    """A root folder and the tools that act inside it."""

    def __init__(self, root, timeout: float = 10.0, max_output: int = 8000, max_file_bytes: int = 200_000,
                 shell_allow: Optional[List[str]] = None, unsafe_no_sandbox: bool = False,
                 max_write_bytes: int = 1 << 20, limits: Optional[processes.Limits] = None,
                 search_seconds: float = 5.0):
        self.root = Path(root).expanduser().resolve()
        if not self.root.is_dir():
            raise SandboxError(f"workspace {root} is not a folder")
        self.timeout, self.max_output, self.max_file_bytes = timeout, max_output, max_file_bytes
        self.max_write_bytes, self.search_seconds = max_write_bytes, search_seconds
        self.shell_allow = list(shell_allow) if shell_allow else None
        self.unsafe_no_sandbox = unsafe_no_sandbox
        self.limits = limits or processes.Limits()  # memory, processes, file size; timeout/output come from here

    # -- paths ---------------------------------------------------------------------------------
    def _parts(self, rel) -> List[str]:
        """The components of a workspace-relative path; SandboxError for absolute paths and '..'."""
        if not isinstance(rel, str) or "\x00" in rel:
            raise SandboxError("refused: a path must be a plain string")
        if rel.startswith(("/", "\\", "~")) or re.match(r"^[A-Za-z]:", rel):
            raise SandboxError(f"refused: {rel!r} is absolute; use a path relative to the workspace")
        parts = [p for p in rel.replace("\\", "/").split("/") if p not in ("", ".")]
        if ".." in parts:
            raise SandboxError(f"refused: {rel!r} goes up with '..'; stay inside the workspace")
        return parts

    def path(self, rel: str) -> Path:
        """The resolved path of `rel` inside the root (a lexical check for shell arguments)."""
        parts = self._parts(rel)
        full = self.root.joinpath(*parts).resolve()
        if full != self.root and self.root not in full.parents:
            raise SandboxError(f"refused: {rel!r} leads outside the workspace (through a symlink)")
        return full

    def _link_target(self, dir_fd: int, name: str, at: List[str], rel: str) -> List[str]:
        """Components (from the root) a symlink `at/name` points to; SandboxError when it leads out."""
        target = os.readlink(name, dir_fd=dir_fd)
        root = str(self.root)
        if target.startswith("/"):
            if target != root and not target.startswith(root + "/"):
                raise SandboxError(f"refused: {rel!r} leads outside the workspace (through a symlink)")
            base, target = [], target[len(root):]
        else:
            base = list(at)
        for part in target.split("/"):
            if part in ("", "."):
                continue
            if part == "..":
                if not base:
                    raise SandboxError(f"refused: {rel!r} leads outside the workspace (through a symlink)")
                base.pop()
            else:
                base.append(part)
        return base

    def _walk(self, rel: str, create_dirs: bool = False, final_dir: bool = False):
        """(dir fd, final name, components) for `rel`, each folder opened O_NOFOLLOW relative to the one
        before; symlinks are followed only inside the root. The caller closes the fd."""
        todo, hops = self._parts(rel), 0
        if final_dir:
            todo = todo + ["."]
        while True:
            fd, at = os.open(self.root, DIR_FLAGS), []
            try:
                restart = None
                for i, part in enumerate(todo[:-1] if todo else []):
                    if create_dirs:
                        try:
                            os.mkdir(part, 0o755, dir_fd=fd)
                        except FileExistsError:
                            pass
                    try:
                        nfd = os.open(part, DIR_FLAGS, dir_fd=fd)
                    except OSError as e:
                        if e.errno not in (errno.ELOOP, errno.ENOTDIR) or not _is_link(fd, part):
                            raise SandboxError(f"no folder {'/'.join(at + [part])!r} in the workspace") from None
                        restart = self._link_target(fd, part, at, rel) + todo[i + 1:]
                        break
                    os.close(fd)
                    fd, at = nfd, at + [part]
                if restart is None:
                    return fd, (todo[-1] if todo else "."), at
                os.close(fd)
            except BaseException:
                _close(fd)
                raise
            hops += 1
            if hops > MAX_LINKS:
                raise SandboxError(f"refused: {rel!r} has too many symlinks")
            todo = restart or ["."]

    def _open(self, rel: str, flags: int, create_dirs: bool = False, mode: int = 0o644):
        """(fd, dir fd, final name) of the file `rel`, opened O_NOFOLLOW at the end of a checked walk."""
        for _ in range(MAX_LINKS):
            dfd, name, at = self._walk(rel, create_dirs)
            try:
                return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dfd), dfd, name
            except OSError as e:
                if e.errno != errno.ELOOP or not _is_link(dfd, name):
                    os.close(dfd)
                    raise
                rel = "/".join(self._link_target(dfd, name, at, rel)) or "."
                os.close(dfd)
        raise SandboxError("refused: too many symlinks")

    def _read_bytes(self, rel: str) -> bytes:
        try:
            fd, dfd, _ = self._open(rel, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            raise SandboxError(f"no file {rel!r} in the workspace") from None
        os.close(dfd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SandboxError(f"no file {rel!r} in the workspace (not a regular file)")
            if st.st_nlink > 1:
                raise SandboxError(f"refused: {rel!r} is a hard link ({st.st_nlink} names); it may lead outside")
            return os.pread(fd, self.max_file_bytes, 0)
        finally:
            os.close(fd)

    # -- file tools ----------------------------------------------------------------------------
    def read_file(self, path: str) -> str:
        """Read a text file in the workspace.

        Args:
            path: file path relative to the workspace
        """
        return self._read_bytes(path).decode("utf-8", errors="replace")

    def list_dir(self, path: str = ".") -> str:
        """List a folder in the workspace: one entry per line, folders end with '/'.

        Args:
            path: folder path relative to the workspace
        """
        dfd, _, _ = self._walk(path, final_dir=True)
        try:
            with os.scandir(dfd) as it:
                rows = sorted(e.name + ("/" if e.is_dir(follow_symlinks=False) else "") for e in it)
        finally:
            os.close(dfd)
        return "\n".join(rows) or "(empty)"

    def write_file(self, path: str, content: str) -> str:
        """Write a text file in the workspace (creates folders; replaces an existing file).

        Args:
            path: file path relative to the workspace
            content: the full text to write
        """
        data = content.encode("utf-8") if isinstance(content, str) else None
        if data is None:
            raise SandboxError("refused: content must be text")
        if len(data) > self.max_write_bytes:
            raise SandboxError(f"refused: {len(data)} bytes is over the {self.max_write_bytes}-byte write limit")
        if not self._parts(path):
            raise SandboxError(f"refused: {path!r} is the workspace folder itself")
        fd, dfd, name = self._open(path, os.O_RDONLY | os.O_CREAT | os.O_NONBLOCK, create_dirs=True)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SandboxError(f"refused: {path!r} is not a regular file")
            if st.st_nlink > 1:
                raise SandboxError(f"refused: {path!r} is a hard link ({st.st_nlink} names); it may lead outside")
            tmp = f".{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
            tfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd)
            try:
                os.write(tfd, data)
                os.fsync(tfd)
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)  # a new inode: never writes through a link
            except BaseException:
                _unlink(tmp, dfd)
                raise
            finally:
                os.close(tfd)
        finally:
            os.close(fd)
            os.close(dfd)
        return f"wrote {len(data)} bytes to {path}"

    def search_files(self, pattern: str, path: str = ".") -> str:
        """Find lines matching a text pattern (a regular expression) in workspace files.

        Args:
            pattern: text or regular expression to look for
            path: folder to search, relative to the workspace
        """
        rx = _compile(pattern)
        deadline = time.monotonic() + self.search_seconds
        dfd, _, at = self._walk(path, final_dir=True)
        hits, skipped = [], []
        try:
            for parts, tfd, files in trees.walk(dfd, skipped=skipped):  # fd-relative, never follows symlinks
                for fname in files:
                    rel = "/".join(at + parts + [fname])
                    for n, line in enumerate(self._search_one(tfd, fname), 1):
                        left = deadline - time.monotonic()
                        found = _timed_search(rx, line, left) if left > 0 else None
                        if found is None:
                            return "\n".join(hits + [f"[search stopped: the pattern took longer than "
                                                     f"{self.search_seconds:g} s; try a simpler one]"])
                        if found:
                            hits.append(f"{rel}:{n}: {line.strip()[:200]}")
                            if len(hits) >= 50:
                                return "\n".join(hits + ["[stopped at 50 matches]"])
        finally:
            os.close(dfd)
        note = [f"[not searched: {len(skipped)} folder(s) deeper than {trees.MAX_OPEN} levels]"] if skipped else []
        return "\n".join(hits + note) or f"no match for {pattern!r}"

    def _search_one(self, dir_fd: int, name: str) -> List[str]:
        """Lines of one regular, singly-linked file (symlinks, hard links, FIFOs skipped)."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError:
            return []
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
                return []
            return os.pread(fd, self.max_file_bytes, 0).decode("utf-8", "replace").splitlines()
        finally:
            os.close(fd)

    # -- processes -----------------------------------------------------------------------------
    def run_python(self, code: str) -> str:
        """Run a Python snippet in the workspace and return what it prints (stdout and stderr).

        Args:
            code: the Python source to run
        """
        return self._run([sys.executable, "-I", "-u", "-c", code])  # -u: output printed before a kill is kept

    def shell(self, command: str) -> str:
        """Run an allowed shell command in the workspace and return its output.

        Args:
            command: the command line, e.g. "ls -la"
        """
        if self.shell_allow is None:
            raise SandboxError("the shell tool is disabled for this workspace")
        argv = shlex.split(command)
        if not argv or argv[0] not in self.shell_allow:
            raise SandboxError(f"refused: {argv[0] if argv else '(empty)'!r} is not allowed; allowed: {', '.join(self.shell_allow)}")
        for a in argv[1:]:  # a convenience for honest mistakes; the OS sandbox is what confines the command
            if not a.startswith("-") and ("/" in a or a.startswith("~") or ".." in a):
                self.path(a)
        return self._run(argv)

    def sandbox_mode(self) -> str:
        """'landlock' | 'seatbelt' | 'none' (only with unsafe_no_sandbox); SandboxError when code tools
        must stay disabled (fail closed)."""
        m = processes.mechanism()
        if m.name:
            return m.name
        if self.unsafe_no_sandbox:
            return "none"
        raise SandboxError(f"code tools are disabled: no OS sandbox on this machine ({m.detail}); "
                           "pass unsafe_no_sandbox=True (CLI: --unsafe-no-sandbox) to run them unconfined")

    def _run(self, argv: List[str]) -> str:
        mode = self.sandbox_mode()
        limits = dataclasses.replace(self.limits, timeout=self.timeout, output_chars=self.max_output)
        need_cgroup = mode == "landlock" and processes.mechanism().cgroup  # offered, so never run without it
        out, rc, total = processes.run(argv, str(self.root), limits, mode, need_cgroup=need_cgroup)
        if len(out) > self.max_output or total > len(out.encode()):
            out = out[: self.max_output] + f"\n[output cut: showed {min(len(out), self.max_output)} characters of {total} bytes]"
        if rc is None:
            return out + f"\nerror: timed out after {self.timeout:g} s and was stopped (with every child process)"
        if rc == 126 and "justfit sandbox:" in out:
            raise SandboxError(f"the sandbox could not start: {out.strip()}")
        return out + ("" if rc == 0 else f"\n[exit code {rc}]")

    def tools(self, files=True, write=False, python=False, shell=False) -> List[Tool]:
        """The workspace's tools as Tool objects (refusals become readable results). Asking for code
        tools without a sandbox raises SandboxError (fail closed)."""
        if python or (shell and self.shell_allow):
            self.sandbox_mode()
        names = (["read_file", "list_dir", "search_files"] if files else []) + (["write_file"] if write else [])
        names += (["run_python"] if python else []) + (["shell"] if shell and self.shell_allow else [])
        return [as_tool(_readable(getattr(self, n)), n) for n in names]


def _compile(pattern: str):
    """The pattern compiled by `regex` (whose matching can be time-limited), case-insensitive; a pattern
    that does not compile is searched for as plain text."""
    try:
        return regex.compile(pattern, regex.I)
    except (regex.error, ValueError, OverflowError, RecursionError):
        return regex.compile(regex.escape(pattern), regex.I)


def _timed_search(rx, line: str, seconds: float):
    """True / False for a match in line, None when matching ran past `seconds` (catastrophic patterns)."""
    try:
        return rx.search(line, timeout=seconds) is not None
    except TimeoutError:
        return None


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
    except OSError:
        return False


def _close(fd):
    try:
        os.close(fd)
    except OSError:
        pass


def _unlink(name, dir_fd):
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


def _readable(method):
    """Turn a SandboxError into the tool result text instead of an exception."""
    def wrapper(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except SandboxError as e:
            return str(e)
        except OSError as e:
            return f"error: {e.strerror or e}"
    wrapper.__doc__, wrapper.__name__, wrapper.__wrapped__ = method.__doc__, method.__name__, method
    wrapper.__signature__ = __import__("inspect").signature(method)
    wrapper.__annotations__ = method.__annotations__
    return wrapper
