"""macOS Seatbelt: the sandbox-exec profile for a tool process (deny by default, read system paths
and the Python install, write only the workspace and a private temp folder, no network).

Generated text only: it is unit-tested here (Linux CI), not run; `sandbox-exec` applies it on a Mac.
"""

import os
import platform

SANDBOX_EXEC = "/usr/bin/sandbox-exec"
SYSTEM_READ = ("/usr", "/bin", "/sbin", "/System", "/Library/Frameworks", "/Library/Apple", "/private/etc",
               "/private/var/db/timezone", "/opt/homebrew", "/usr/local", "/dev/urandom", "/dev/random",
               "/dev/zero")


def _quote(path: str) -> str:
    """A path as a Seatbelt string literal (backslash and quote escaped)."""
    return '"' + str(path).replace("\\", "\\\\").replace('"', '\\"') + '"'


def profile(read_paths, write_paths) -> str:
    """The SBPL profile text: reads under system paths and read_paths, reads and writes under
    write_paths, /dev/null writable, processes may fork and exec, signals only inside the sandbox."""
    reads = sorted(set(SYSTEM_READ) | {os.path.realpath(p) for p in read_paths} | set(read_paths))
    writes = sorted({os.path.realpath(p) for p in write_paths} | set(write_paths))
    lines = ["(version 1)", "(deny default)", "(deny network*)",
             "(allow process-fork)", "(allow process-exec)", "(allow signal (target same-sandbox))",
             "(allow sysctl-read)", '(allow file-read-metadata (literal "/") (literal "/private") (literal "/var"))',
             "(allow file-read* " + " ".join(f"(subpath {_quote(p)})" for p in reads) + ")",
             "(allow file-read* file-write* " + " ".join(f"(subpath {_quote(p)})" for p in writes) + ")",
             '(allow file-read* file-write-data (literal "/dev/null"))']
    return "\n".join(lines) + "\n"


def available() -> bool:
    """True on macOS with sandbox-exec present."""
    return platform.system() == "Darwin" and os.path.exists(SANDBOX_EXEC)
