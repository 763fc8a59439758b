"""Built-in tools confined to a workspace folder: files, search, Python and an opt-in shell.

Paths are resolved (symlinks followed) and must stay inside the root; `..`, absolute paths and
links that lead out are refused with a message the model can read. Subprocesses run with the
workspace as cwd, a timeout, an output cap, a minimal environment and proxies pointed nowhere;
run_python also disables sockets in the child, so no tool reaches the network.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

from .tools import Tool, as_tool

NO_NET = ("import socket as _s\n"
          "def _deny(*a, **k): raise OSError('network access is disabled in the JustFit sandbox')\n"
          "_s.socket = _deny; _s.create_connection = _deny; _s.getaddrinfo = _deny\n"
          "del _s, _deny\n")


class SandboxError(Exception):
    """A request the sandbox refuses; its text is returned to the model as the tool result."""


class Workspace:
    """A root folder and the tools that act inside it."""

    def __init__(self, root, timeout: float = 10.0, max_output: int = 8000, max_file_bytes: int = 200_000,
                 shell_allow: Optional[List[str]] = None):
        self.root = Path(root).expanduser().resolve()
        if not self.root.is_dir():
            raise SandboxError(f"workspace {root} is not a folder")
        self.timeout, self.max_output, self.max_file_bytes = timeout, max_output, max_file_bytes
        self.shell_allow = list(shell_allow) if shell_allow else None

    def path(self, rel: str) -> Path:
        """The resolved path of `rel` inside the root; SandboxError when it would leave it."""
        if not isinstance(rel, str) or "\x00" in rel:
            raise SandboxError("refused: a path must be a plain string")
        if rel.startswith(("/", "\\", "~")) or re.match(r"^[A-Za-z]:", rel):
            raise SandboxError(f"refused: {rel!r} is absolute; use a path relative to the workspace")
        if ".." in Path(rel).parts:
            raise SandboxError(f"refused: {rel!r} goes up with '..'; stay inside the workspace")
        full = (self.root / rel).resolve()
        if full != self.root and self.root not in full.parents:
            raise SandboxError(f"refused: {rel!r} leads outside the workspace (through a symlink)")
        return full

    # -- file tools ----------------------------------------------------------------------------
    def read_file(self, path: str) -> str:
        """Read a text file in the workspace.

        Args:
            path: file path relative to the workspace
        """
        p = self.path(path)
        if not p.is_file():
            raise SandboxError(f"no file {path!r} in the workspace")
        data = p.read_bytes()[: self.max_file_bytes]
        return data.decode("utf-8", errors="replace")

    def list_dir(self, path: str = ".") -> str:
        """List a folder in the workspace: one entry per line, folders end with '/'.

        Args:
            path: folder path relative to the workspace
        """
        p = self.path(path)
        if not p.is_dir():
            raise SandboxError(f"no folder {path!r} in the workspace")
        rows = [e.name + ("/" if e.is_dir() else "") for e in sorted(p.iterdir(), key=lambda e: e.name)]
        return "\n".join(rows) or "(empty)"

    def write_file(self, path: str, content: str) -> str:
        """Write a text file in the workspace (creates folders; replaces an existing file).

        Args:
            path: file path relative to the workspace
            content: the full text to write
        """
        p = self.path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(content, encoding="utf-8")
        return f"wrote {len(content.encode())} bytes to {path}"

    def search_files(self, pattern: str, path: str = ".") -> str:
        """Find lines matching a text pattern (a regular expression) in workspace files.

        Args:
            pattern: text or regular expression to look for
            path: folder to search, relative to the workspace
        """
        base = self.path(path)
        try:
            rx = re.compile(pattern, re.I)
        except re.error:
            rx = re.compile(re.escape(pattern), re.I)
        hits = []
        for f in sorted(base.rglob("*")):
            if not f.is_file() or f.is_symlink() or self.root not in f.resolve().parents:
                continue
            for n, line in enumerate(f.read_bytes()[: self.max_file_bytes].decode("utf-8", "replace").splitlines(), 1):
                if rx.search(line):
                    hits.append(f"{f.relative_to(self.root)}:{n}: {line.strip()[:200]}")
                    if len(hits) >= 50:
                        return "\n".join(hits + ["[stopped at 50 matches]"])
        return "\n".join(hits) or f"no match for {pattern!r}"

    # -- processes -----------------------------------------------------------------------------
    def run_python(self, code: str) -> str:
        """Run a Python snippet in the workspace and return what it prints (stdout and stderr).

        Args:
            code: the Python source to run
        """
        return self._run([sys.executable, "-I", "-c", NO_NET + code])

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
        for a in argv[1:]:  # arguments that look like paths must stay inside too
            if not a.startswith("-") and ("/" in a or a.startswith("~") or ".." in a):
                self.path(a)
        return self._run(argv)

    def _run(self, argv: List[str]) -> str:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.root), "PYTHONIOENCODING": "utf-8",
               "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "no_proxy": ""}
        try:
            p = subprocess.run(argv, cwd=self.root, env=env, capture_output=True, timeout=self.timeout,
                               stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return f"error: timed out after {self.timeout:g} s and was stopped"
        out = (p.stdout + p.stderr).decode("utf-8", "replace")
        if len(out) > self.max_output:
            out = out[: self.max_output] + f"\n[output cut: showed {self.max_output} of {len(out)} characters]"
        return out + ("" if p.returncode == 0 else f"\n[exit code {p.returncode}]")

    def tools(self, files=True, write=False, python=False, shell=False) -> List[Tool]:
        """The workspace's tools as Tool objects (refusals become readable results)."""
        names = (["read_file", "list_dir", "search_files"] if files else []) + (["write_file"] if write else [])
        names += (["run_python"] if python else []) + (["shell"] if shell and self.shell_allow else [])
        return [as_tool(_readable(getattr(self, n)), n) for n in names]


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
