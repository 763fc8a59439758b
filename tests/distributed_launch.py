"""Run a command as N ranks with `mlx.launch --backend ring` on loopback, bounded by a timeout."""

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import List

from justfit.distributed.launch import free_port, launch_command, launcher, why_not  # noqa: F401 (re-exported)

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("distributed_worker.py")


def env(**extra) -> dict:
    """The test environment: the worktree and tests importable, the launch variables of an outer run removed."""
    e = {k: v for k, v in os.environ.items() if k not in ("MLX_RANK", "MLX_HOSTFILE", "JUSTFIT_SHARDING")}
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "agents"), str(ROOT / "tests")])
    e.update({k: str(v) for k, v in extra.items()})
    return e


def launch(n: int, args: List[str], timeout: float, **extra_env) -> subprocess.CompletedProcess:
    """`python ARGS` as N ring ranks under mlx.launch (N == 1: the plain process), bounded by `timeout`."""
    cmd = [sys.executable, *map(str, args)]
    if n > 1:
        cmd = launch_command(n, cmd, extra_env)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env(**extra_env))


def last_json(r: subprocess.CompletedProcess) -> dict:
    """The JSON line rank 0 printed; fails the test with both streams when there is none."""
    import json

    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    assert r.returncode == 0 and len(lines) == 1, f"rc={r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr[-3000:]}"
    return json.loads(lines[0])


def rank_process(parent, rank: str, deadline: float):
    """The python process of `rank` among `parent`'s descendants (psutil.Process), None by the deadline."""
    import psutil

    while time.time() < deadline:
        for p in parent.children(recursive=True):
            try:
                if p.environ().get("MLX_RANK") == rank and "python" in p.name():
                    return p
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        time.sleep(0.2)
    return None


def sharp_tiny_folder(src: Path, dst: Path, scale: float = 6.0) -> Path:
    """A copy of a tiny converted model folder with its matrices scaled up: the converted tiny GGUF
    (std 0.5/sqrt(d)) repeats one token, which would make token-equality tests unable to fail."""
    import shutil

    import mlx.core as mx

    if not dst.exists():
        shutil.copytree(src, dst)
        w = mx.load(str(dst / "model.safetensors"))
        mx.save_safetensors(str(dst / "model.safetensors"), {k: v * scale if v.ndim == 2 else v for k, v in w.items()})
    return dst
