"""Give MLX's Linux CPU wheel a fast BLAS: re-exec the CLI with Debian's OpenBLAS preloaded.

The `mlx[cpu]` wheel links the reference BLAS it bundles (~8 GFLOP/s here); preloading OpenBLAS
interposes the same symbols (~120 GFLOP/s). Set JUSTFIT_OPENBLAS=0 to turn this off, or to a path to
use another libblas.so.3.
"""

import importlib.util
import os
import sys
from pathlib import Path
from typing import Optional

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib64/libopenblasp.so.0",
)


def reference_blas_bundled() -> bool:
    """True when the installed MLX links the reference BLAS bundled with the CPU wheel."""
    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        return False
    site = Path(list(spec.submodule_search_locations)[0]).parent
    return any((site / "mlx_cpu.libs").glob("libblas*.so*"))


def openblas_path() -> Optional[str]:
    """The OpenBLAS libblas to preload, or None when disabled or absent."""
    choice = os.environ.get("JUSTFIT_OPENBLAS", "1")
    if choice in ("0", "off", "false", "no"):
        return None
    if choice not in ("1", "on", "true", "yes"):
        return choice if Path(choice).is_file() else None
    return next((c for c in CANDIDATES if Path(c).is_file()), None)


def active_blas() -> str:
    """Which BLAS this process has mapped: 'openblas', 'reference (slow)', 'accelerate' or 'unknown'."""
    if sys.platform == "darwin":
        return "accelerate"
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    paths = {line.split()[-1] for line in maps.splitlines() if "/" in line}
    names = {Path(p).name for p in paths}
    # numpy bundles its own prefixed OpenBLAS (libscipy_openblas*); that one is not MLX's BLAS.
    if any(n.startswith("libopenblas") or ("openblas" in p and Path(p).name.startswith("libblas.so"))
           for p in paths for n in [Path(p).name]):
        return "openblas"
    return "reference (slow)" if any(n.startswith("libblas-") for n in names) else "not loaded yet"


def maybe_reexec(argv, module: str = "justfit") -> None:
    """Re-exec `python -m module argv[1:]` once with OpenBLAS in LD_PRELOAD when that makes MLX
    faster and is safe (the CLI, and the test suite through tests/conftest.py)."""
    if not sys.platform.startswith("linux") or os.environ.get("JUSTFIT_BLAS_REEXEC"):
        return
    lib = openblas_path()
    preload = os.environ.get("LD_PRELOAD", "")
    if lib is None or "openblas" in preload or not reference_blas_bundled():
        return
    env = dict(os.environ, JUSTFIT_BLAS_REEXEC="1", LD_PRELOAD=f"{lib} {preload}".strip())
    try:
        os.execve(sys.executable, [sys.executable, "-m", module, *argv[1:]], env)
    except OSError:
        return  # keep running without it rather than fail
