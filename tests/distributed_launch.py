"""Run a command as N ranks with `mlx.launch --backend ring` on loopback, bounded by a timeout."""

import functools
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("distributed_worker.py")


def env(**extra) -> dict:
    """The test environment: the worktree and tests importable, the launch variables of an outer run removed."""
    e = {k: v for k, v in os.environ.items() if k not in ("MLX_RANK", "MLX_HOSTFILE", "JUSTFIT_SHARDING")}
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "agents"), str(ROOT / "tests")])
    e.update({k: str(v) for k, v in extra.items()})
    return e


def free_port() -> int:
    """A loopback port p with p+1 also free (mlx.launch's ring listens on one port per rank)."""
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


def launcher() -> Optional[str]:
    return shutil.which("mlx.launch", path=str(Path(sys.executable).parent)) or shutil.which("mlx.launch")


@functools.lru_cache(maxsize=1)
def why_not() -> Optional[str]:
    """None when `mlx.launch -n 2 --backend ring` can run two ranks here, else the reason."""
    exe = launcher()
    if exe is None:
        return "mlx.launch is not installed"
    code = "import mlx.core as mx; g = mx.distributed.init(backend='ring'); print(mx.distributed.all_sum(mx.array([1]), group=g).item())"
    probe = Path(os.environ.get("TMPDIR", "/tmp")) / f"justfit-ring-probe-{os.getpid()}.py"
    probe.write_text(code)
    try:
        r = subprocess.run([exe, "-n", "2", "--backend", "ring", "-p", str(free_port()), "--python", sys.executable,
                            str(probe)], capture_output=True, text=True, timeout=90, env=env())
    except subprocess.TimeoutExpired:
        return "mlx.launch -n 2 --backend ring did not finish a one-value all_sum in 90 s"
    finally:
        probe.unlink(missing_ok=True)
    if r.stdout.split() != ["2", "2"]:
        return f"mlx.launch -n 2 --backend ring failed here: {(r.stderr or r.stdout).strip()[-200:]}"
    return None


def launch(n: int, args: List[str], timeout: float, python: bool = True, **extra_env) -> subprocess.CompletedProcess:
    """`mlx.launch -n N --backend ring -p PORT [--python PY] ARGS` (N == 1: the command alone)."""
    cmd = ([sys.executable] if python else []) + [str(a) for a in args]
    if n > 1:
        cmd = [launcher(), "-n", str(n), "--backend", "ring", "-p", str(free_port())] + \
              [f"--env={k}={v}" for k, v in extra_env.items()] + (["--python", sys.executable] if python else []) + \
              ["--"] + [str(a) for a in args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env(**extra_env))


def last_json(r: subprocess.CompletedProcess) -> dict:
    """The JSON line rank 0 printed; fails the test with both streams when there is none."""
    import json

    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    assert r.returncode == 0 and len(lines) == 1, f"rc={r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr[-3000:]}"
    return json.loads(lines[0])
