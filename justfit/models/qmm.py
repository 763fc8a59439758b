"""Quantized linear layers on the CPU for decode-sized inputs: qmm.c, built on first use, called via ctypes.

MLX has no custom-kernel API for its CPU backend and its CPU quantized_matmul is scalar code, so without
this the weights had to be dequantized to float32 (8x the bytes a decode step reads). qmm.c reads
mlx-lm's packed affine weights (bits 4 and 8, groups 32/64/128) where they lie, for 1-16 rows of x.

Built with the system C compiler (`$CC`, else cc or gcc) into JUSTFIT_HOME/kernels/, once per source
version. Variants: AVX2+FMA and AVX-512 on x86-64 (the CPU's flags say which may run; tuning.py times
them), NEON on arm64 (compiled only there; it could not be run where it was written). Anywhere else, with
no compiler, or with JUSTFIT_CPU_KERNELS=0, `available()` is False and MLX's own ops run. A C call is not a
node of MLX's lazy graph: its input is evaluated first, one host synchronization a call; so one call
takes every weight that reads the same input (`matmul(x, weights)`).
"""

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import threading
import weakref
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np

from .. import config

SOURCE = Path(__file__).with_name("qmm.c")
FLAGS = ("-O3", "-shared", "-fPIC", "-pthread")
CALLS = Counter()  # "qmm": calls the kernel served (tests and benches check that it ran)
MAX_ROWS = 64  # qmm.c's limit; qlinear.py sends up to tuning's measured `kernel_rows` rows, BLAS above
AVX2, AVX512, NEON = 1, 2, 3
VARIANT_NAMES = {AVX2: "avx2", AVX512: "avx512", NEON: "neon"}
JOB = np.dtype([("w", np.uintp), ("s", np.uintp), ("b", np.uintp), ("y", np.uintp), ("n", np.int64),
                ("ldy", np.int64)], align=True)  # job_t
_state = {"lib": None, "tried": False, "why": ""}
_lock = threading.Lock()


def switched_off() -> bool:
    """JUSTFIT_CPU_KERNELS=0 (read at every call, so one process can compare both paths)."""
    return config.switched_off("JUSTFIT_CPU_KERNELS")


def cpu_flags() -> frozenset:
    """The CPU's feature flags from /proc/cpuinfo (x86 'flags', arm 'Features'); empty where unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def runnable_variants() -> tuple:
    """Variants this CPU can run: AVX2 with avx2+fma, AVX512 with avx512f/bw/dq/vl too, NEON on arm64."""
    machine = platform.machine().lower()
    if machine in ("arm64", "aarch64"):
        return (NEON,)
    if machine not in ("x86_64", "amd64"):
        return ()
    flags = cpu_flags()
    out = []
    if {"avx2", "fma"} <= flags:
        out.append(AVX2)
        if {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags:
            out.append(AVX512)
    return tuple(out)


def supported() -> bool:
    """MLX computes on the CPU of a machine with a variant it can run."""
    return mx.default_device() == mx.cpu and bool(runnable_variants())


def library():
    """The loaded kernel, built on first use; None where it cannot run here (see the module doc)."""
    if not _state["tried"]:
        with _lock:
            if not _state["tried"]:
                _state["lib"] = _load() if supported() else None
                _state["tried"] = True
    return _state["lib"]


def available() -> bool:
    """The kernel runs here now (built, supported, not switched off)."""
    return not switched_off() and library() is not None


def status() -> str:
    """Why the kernel does or does not run here, for `justfit info`."""
    if switched_off():
        return "off (JUSTFIT_CPU_KERNELS=0)"
    if not supported():
        return "off (needs MLX on a CPU with AVX2+FMA, AVX-512 or NEON)"
    return "built" if library() is not None else f"off ({_state['why']})"


def _load():
    from ..atomic import atomic_write
    from ..config import home
    from ..errors import UserError

    tag = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + platform.machine().encode()).hexdigest()[:16]
    try:
        path = home() / "kernels" / f"qmm-{tag}.so"
        if not path.exists():
            cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
            if cc is None:
                _state["why"] = "no C compiler: install gcc or set CC"
                return None
            atomic_write(path, lambda tmp: subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(tmp)],
                                                          check=True, capture_output=True, timeout=120))
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError, UserError) as e:  # MLX's path runs instead
        detail = getattr(e, "stderr", None) or str(e) or type(e).__name__
        _state["why"] = "build failed: " + (detail.decode(errors="replace") if isinstance(detail, bytes) else detail)[:300]
        return None
    lib.qmm.restype = ctypes.c_int
    lib.qmm.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p] + [ctypes.c_int] * 5
    lib.qmm_variants.restype = ctypes.c_int
    return lib


def host(a: mx.array) -> np.ndarray:
    """A C-contiguous numpy view of an evaluated MLX array, copied only when it is strided."""
    return np.ascontiguousarray(np.asarray(a))


def takes(x: mx.array, weights, max_rows: int = MAX_ROWS) -> bool:
    """True when one qmm call can compute x @ dequant(W)^T for every (w, scales, biases, group_size, bits)
    in `weights`: 1 to max_rows rows, float32, one bits/group size, float32 scales and biases."""
    if x.dtype != mx.float32 or x.ndim < 1 or not weights:
        return False
    rows = x.size // x.shape[-1] if x.shape[-1] else 0
    if not 1 <= rows <= min(max_rows, MAX_ROWS):
        return False
    gs, bits = weights[0][3], weights[0][4]
    return all(s.dtype == b.dtype == mx.float32 and g == gs and n == bits and w.dtype == mx.uint32
               for w, s, b, g, n in weights) and bits in (4, 8) and gs in (32, 64, 128)


def matmul(x: mx.array, weights, variant: int, threads: int) -> list:
    """[x @ dequant(W)^T for each weight] (float32, x's leading shape), in one kernel call; `weights` as in
    takes(). Evaluates x (a host synchronization)."""
    K = x.shape[-1]
    lead = x.shape[:-1]
    mx.eval(x)
    xh = host(x).reshape(-1, K)  # reshaped by numpy: an MLX reshape is one more graph op, evaluated here (~70 us)
    M = xh.shape[0]
    jobs, keep = _jobs(weights)
    outs = [np.empty((M, w.shape[0]), np.float32) for w, _, _, _, _ in weights]
    jobs["y"] = [o.ctypes.data for o in outs]
    rc = library().qmm(xh.ctypes.data, M, K, jobs.ctypes.data, len(weights), weights[0][4], weights[0][3], variant, threads)
    del keep
    if rc != 0:
        raise ValueError("qmm declined its arguments (takes() should have refused them)")
    CALLS["qmm"] += 1
    return [mx.array(o.reshape(*lead, o.shape[1])) for o in outs]


_prepared = {}  # ids of a call's weight arrays -> (weak references to them, their job_t rows)
PREPARED_MAX = 4096


def _jobs(weights):
    """(job_t rows for these weights with y unset, views to keep alive during the call). The rows of a
    weight list seen before come from _prepared: its arrays are held weakly, so the rows are reused only
    while the very same arrays live (a PhaseSwap release drops them, and their entry with them); the
    pointers of numpy views are what a decode step paid ~40 us a call for."""
    arrays = [a for w in weights for a in w[:3]]
    key = tuple(map(id, arrays))
    hit = _prepared.get(key)
    if hit is not None and all(r() is a for r, a in zip(hit[0], arrays)):
        return hit[1].copy(), ()
    views = [np.asarray(a) for a in arrays]
    direct = all(v.flags.c_contiguous for v in views)
    views = [np.ascontiguousarray(v) for v in views]
    jobs = np.zeros(len(weights), JOB)
    for i, (w, _, _, _, _) in enumerate(weights):
        jobs[i] = (views[3 * i].ctypes.data, views[3 * i + 1].ctypes.data, views[3 * i + 2].ctypes.data, 0,
                   w.shape[0], w.shape[0])
    if direct:  # pointers into the arrays' own buffers: valid while those arrays live
        if len(_prepared) >= PREPARED_MAX:
            _prepared.clear()
        _prepared[key] = ([weakref.ref(a) for a in arrays], jobs.copy())
    return jobs, views
