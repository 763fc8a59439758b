"""Start N local ranks with `mlx.launch --backend ring` (loopback): the command line and a probe."""

import functools
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional


def launcher() -> Optional[str]:
    """mlx.launch next to this Python, else on PATH."""
    return shutil.which("mlx.launch", path=str(Path(sys.executable).parent)) or shutil.which("mlx.launch")


def free_port() -> int:
    """A loopback port p with p+1 also free (the ring listens on one port per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no free pair of loopback ports")


def launch_command(n: int, command: List[str], env: Optional[dict] = None) -> List[str]:
    """`mlx.launch -n N --backend ring -p PORT [--env K=V ...] -- COMMAND` on this host."""
    exe = launcher()
    if exe is None:
        raise RuntimeError("mlx.launch is not installed")
    extra = [f"--env={k}={v}" for k, v in (env or {}).items()]
    return [exe, "-n", str(n), "--backend", "ring", "-p", str(free_port()), *extra, "--", *map(str, command)]


@functools.lru_cache(maxsize=1)
def why_not(timeout: float = 90) -> Optional[str]:
    """None when two ring ranks can start here and all_sum one value, else the reason they cannot."""
    if launcher() is None:
        return "mlx.launch is not installed"
    code = "import mlx.core as mx; g = mx.distributed.init(backend='ring'); print(mx.distributed.all_sum(mx.array([1]), group=g).item())"
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(code)
    env = {k: v for k, v in os.environ.items() if k not in ("MLX_RANK", "MLX_HOSTFILE")}
    try:
        r = subprocess.run(launch_command(2, [sys.executable, f.name]), capture_output=True, text=True,
                           timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return f"mlx.launch -n 2 --backend ring did not finish a one-value all_sum in {timeout:.0f} s"
    finally:
        os.unlink(f.name)
    if r.stdout.split() != ["2", "2"]:
        return f"mlx.launch -n 2 --backend ring failed here: {(r.stderr or r.stdout).strip()[-200:]}"
    return None
