"""Give MLX's Linux CPU wheel a fast BLAS: `import justfit` loads Debian's OpenBLAS before MLX.

The `mlx[cpu]` wheel links the reference BLAS it bundles, an order of magnitude slower than OpenBLAS
(docs/benchmarks.md); OpenBLAS loaded with RTLD_GLOBAL first interposes the same symbols, like LD_PRELOAD
but in-process, so the CLI, the tests and Python users all get it without a re-exec. JUSTFIT_OPENBLAS=0
turns it off; a path uses another libblas.so.3. Its worker threads are told to sleep as soon as a call ends
(OPENBLAS_THREAD_TIMEOUT, unless set): by default they spin ~0.1 s after every call, which on a small
machine takes the cores MLX's other CPU streams need (parallel attention, kvexec/streams.py).
"""

import ctypes
import importlib.util
import os
import sys
import warnings
from pathlib import Path
from typing import Optional

from .config import switched_off

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib64/libopenblasp.so.0",
)
THREAD_TIMEOUT = "4"  # OpenBLAS workers spin 2^4 cycles after a call, then sleep (the default is 2^28)
_LOADED = False


def reference_blas_bundled() -> bool:
    """True when the installed MLX links the reference BLAS bundled with the CPU wheel."""
    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        return False
    # every location: a folder named mlx in the working directory (an MLX checkout) comes first in the
    # namespace path and holds no wheel libraries
    return any(any((Path(loc).parent / "mlx_cpu.libs").glob("libblas*.so*")) for loc in spec.submodule_search_locations)


def openblas_path() -> Optional[str]:
    """The OpenBLAS libblas to preload, or None when disabled or absent."""
    if switched_off("JUSTFIT_OPENBLAS"):
        return None
    choice = os.environ.get("JUSTFIT_OPENBLAS", "1")
    if choice.strip().lower() not in ("1", "on", "true", "yes"):  # as switched_off reads its words
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


def load_openblas() -> bool:
    """Load OpenBLAS into this process before MLX is imported, so MLX's BLAS calls resolve to it
    (a library loaded RTLD_GLOBAL is searched before MLX's own dependencies). True when loaded."""
    global _LOADED
    if _LOADED or not sys.platform.startswith("linux") or "mlx.core" in sys.modules:
        return _LOADED
    lib = openblas_path()
    if lib is None or not reference_blas_bundled():
        return False
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", THREAD_TIMEOUT)  # read once, when the library loads
    try:
        ctypes.CDLL(lib, mode=os.RTLD_GLOBAL)
    except OSError:
        return False  # keep running on the reference BLAS rather than fail
    _LOADED = True
    return True


def use_fast_blas() -> None:
    """Called by `import justfit`: load OpenBLAS when MLX is not imported yet; when MLX was imported
    first with the reference BLAS, warn once how to get the fast one."""
    if load_openblas() or "mlx.core" not in sys.modules or switched_off("JUSTFIT_OPENBLAS"):
        return
    if sys.platform.startswith("linux") and openblas_path() and active_blas().startswith("reference"):
        warnings.warn(
            "MLX was imported before justfit and uses its slow reference BLAS (6-10x slower on CPU): "
            "`import justfit` before `mlx`, or run with OPENBLAS_THREAD_TIMEOUT=4 LD_PRELOAD=" + openblas_path(),
            RuntimeWarning, stacklevel=3)
