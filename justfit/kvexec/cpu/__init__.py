"""One decode query over a layer's 4-bit pages on x86-64 CPUs: q4.c, built on first use, called via ctypes.

MLX has no custom-kernel API for its CPU backend, and its CPU `quantized_matmul` runs one query row at a
time in scalar code: decode over 4-bit pages ran no faster than mlx-lm's float32 cache over 7x the bytes.
q4.c unpacks each code once for every query row of its KV head, in AVX2 vectors, and does a
layer's whole attention over all its pages (sealed 4-bit, bfloat16, the float32 open page) in one call,
reading the pages where they are (benchmarks/repro/cpu_q4_kernel.py measures it; docs/benchmarks.md has the timings). One call takes every
sequence of a batch and, past THREAD_WORK, deals their heads to one thread per CPU (`threads`).

Built with the system C compiler (`$CC`, else cc or gcc) into JUSTFIT_HOME/kernels/, once per source
version. It runs where MLX computes on the CPU of an x86-64 machine with AVX2 and FMA; anywhere else, with
no compiler, or with JUSTFIT_CPU_KERNELS=0, `decodes` is False and KVExec's MLX-ops path runs (the same
result up to float32 rounding). A C function cannot be a node of MLX's lazy graph, so a call evaluates its
inputs first: one synchronization a layer.
"""

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import threading
from collections import Counter
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from ... import config

SOURCE = Path(__file__).with_name("q4.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-shared", "-fPIC", "-pthread")
CALLS = Counter()  # "decode": layer calls the kernel served (tests and benches check that it ran)
QUANT, BF16, F32 = 0, 1, 2  # page kinds q4.c reads
PAGE = np.dtype([("kind", np.int32), ("n", np.int32), ("k", np.uintp), ("ks", np.uintp), ("kb", np.uintp),
                 ("v", np.uintp), ("vs", np.uintp), ("vb", np.uintp), ("hs", np.int64)], align=True)  # page_t
SEQ = np.dtype([("q", np.uintp), ("pages", np.uintp), ("np", np.int32), ("out", np.uintp)], align=True)  # seq_t
THREAD_WORK = 32768  # tokens x query rows of a call below which one thread does it all (less work than this
# does not pay for starting and joining a second thread)
MAX_THREADS = 16  # q4.c's cap
_state = {"lib": None, "tried": False, "why": ""}
_lock = threading.Lock()


def switched_off() -> bool:
    """JUSTFIT_CPU_KERNELS=0 (read at every call, so one process can compare both paths)."""
    return config.switched_off("JUSTFIT_CPU_KERNELS")


def supported() -> bool:
    """True on an x86-64 CPU with AVX2 and FMA while MLX computes on the CPU."""
    if platform.machine() not in ("x86_64", "AMD64") or mx.default_device() != mx.cpu:
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return False
    return {"avx2", "fma"} <= flags


def status() -> str:
    """One line for `justfit info`: whether the kernel runs here and, if not, why."""
    if switched_off():
        return "off (JUSTFIT_CPU_KERNELS=0)"
    if not supported():
        return "off (needs MLX on the CPU of an x86-64 machine with AVX2 and FMA)"
    return "on" if library() is not None else f"off ({_state['why']})"


def library():
    """The loaded kernel, built on first use; None where it cannot run here (see the module doc)."""
    if not _state["tried"]:
        with _lock:
            if not _state["tried"]:
                _state["lib"] = _load() if supported() else None
                _state["tried"] = True
    return _state["lib"]


def _load():
    from ...atomic import atomic_write
    from ...config import home
    from ...errors import UserError

    tag = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    try:
        path = home() / "kernels" / f"q4-{tag}.so"
        if not path.exists():
            cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
            if cc is None:
                _state["why"] = "no C compiler: install gcc or set CC"
                return None
            atomic_write(path, lambda tmp: subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(tmp), "-lm"],
                                                          check=True, capture_output=True, timeout=120))
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError, UserError) as e:  # MLX's path runs instead
        detail = getattr(e, "stderr", None) or str(e) or type(e).__name__
        _state["why"] = "build failed: " + (detail.decode(errors="replace") if isinstance(detail, bytes) else detail)[:300]
        return None
    lib.q4_decode_batch.restype = ctypes.c_int
    lib.q4_decode_batch.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 5
    return lib


def decodes(key_codec, value_codec) -> bool:
    """True when q4_decode reads this config's 4-bit pages: channel keys in 64-token groups and affine values
    in 64-element groups, both 4 bits with bfloat16 scales (a float32 model's storage), head dim a multiple
    of 64 up to 256; and the kernel runs here."""
    k, v = key_codec, value_codec
    return (not switched_off() and getattr(k, "name", "") == "channel" and getattr(v, "name", "") == "affine"
            and k.bits == v.bits == 4 and k.group_size == v.group_size == 64 and k.store == v.store == mx.bfloat16
            and k.dim == v.dim and k.dim % 64 == 0 and k.dim <= 256 and library() is not None)


def float_kind(a: mx.array) -> Optional[int]:
    """BF16 or F32 for a float page's array, None for a dtype the kernel does not read."""
    return {mx.bfloat16: BF16, mx.float32: F32}.get(a.dtype)


def _host(a: mx.array) -> np.ndarray:
    """A C-contiguous numpy view of an evaluated MLX array (bfloat16 as its uint16 bits), copied only when
    strided."""
    if a.dtype == mx.bfloat16:
        try:
            return np.frombuffer(memoryview(a).cast("B"), np.uint16).reshape(a.shape)
        except (TypeError, ValueError):  # strided: a contiguous copy
            return np.ascontiguousarray(np.asarray(a.view(mx.uint16)))
    return np.ascontiguousarray(np.asarray(a))


def page_row(kind: int, n: int, keys, values) -> tuple:
    """(a PAGE record for a page's evaluated parts, the host views it points into: keep them while it is used).
    keys and values are the page's parts: (codes, scales, biases) for QUANT, (array,) for a float page."""
    views = [_host(a) for a in (*keys, *values)]
    if kind == QUANT:
        return (kind, n, *[v.ctypes.data for v in views], 0), views
    k, v = views
    return (kind, n, k.ctypes.data, 0, 0, v.ctypes.data, 0, 0, k.strides[0] // k.itemsize), views


def decode(q: mx.array, tables, page_size: int) -> Optional[mx.array]:
    """softmax(q k^T) v for B sequences, each over the pages of its table (PAGE records in token order, their
    arrays evaluated); q [B, X, R, D] float32, pre-scaled and evaluated -> [B, X, R, D] float32, or None if
    the kernel declines one. One call for all B: q4.c deals their heads to threads (see threads())."""
    B, X, R, D = q.shape
    qh = _host(q)
    out = np.empty((B, X, R, D), np.float32)
    tokens = [int(rows["n"].sum()) for rows in tables]
    n = threads(sum(tokens) * X * R, B * X * -(-R // 4))
    per_thread = 4 * max(tokens)
    scratch = np.empty(n * per_thread, np.float32)
    step = X * R * D * 4
    seqs = np.zeros(B, SEQ)
    seqs["q"] = qh.ctypes.data + step * np.arange(B, dtype=np.uintp)
    seqs["out"] = out.ctypes.data + step * np.arange(B, dtype=np.uintp)
    seqs["pages"] = [rows.ctypes.data for rows in tables]
    seqs["np"] = [len(rows) for rows in tables]
    if library().q4_decode_batch(seqs.ctypes.data, B, scratch.ctypes.data, per_thread, X, R, D, page_size, n) != 0:
        return None
    CALLS["decode"] += 1
    return mx.array(out)


def threads(work: int, items: int) -> int:
    """Threads for a call of `work` tokens x query rows in `items` head items: the CPUs this process may use
    (MLX's own threads are idle, decode evaluated its inputs first), one below THREAD_WORK;
    JUSTFIT_CPU_THREADS caps it."""
    if work < THREAD_WORK:
        return 1
    cap = os.environ.get("JUSTFIT_CPU_THREADS")
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if cap is not None and cap.isdigit() and int(cap) >= 1:
        n = min(n, int(cap))
    return max(1, min(n, items, MAX_THREADS))
