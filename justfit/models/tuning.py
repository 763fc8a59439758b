"""Speed choices measured on the machine that runs them, once, and cached.

A constant tuned on one machine is a guess on the next (row-major float weights won 1.17x on one CPU and
lost 0.8x on another), so each choice the CPU path makes is timed on first use, in a few hundred ms:
- kernel variant (AVX2 / AVX-512 / NEON) and threads for qmm.c, on a synthetic 4-bit one-row product;
- quantized weights + kernel vs float32 weights, on the same product (the faster wins the default);
- up to how many rows (16, 32, 64) the kernel beats dequantizing the weight and BLAS (`kernel_rows`);
- row-major float weights (x @ W) vs mlx-lm's layout (x @ W.T), for the float32 path.
The answers are kept in $JUSTFIT_HOME/tuning/cpu-<key>.json, keyed by the CPU's model name and flags and
the mlx and justfit versions and the kernel source (any change re-measures), and shown by `justfit info`.
"""

import hashlib
import json
import os
import platform
import statistics
import threading
import time

from . import qmm

SHAPE = (4096, 2048)  # [out, in] of the timed weight: 32 MB in float32, 4 MB in 4 bits (past the caches)
REPS = 5
_state = {"choices": None}
_lock = threading.Lock()


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else platform.processor()."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "cpu model", "hardware")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_key() -> dict:
    """What the measurements depend on: the CPU and the library versions."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        justfit = version("justfit")
    except PackageNotFoundError:  # a bare checkout on PYTHONPATH
        justfit = "unknown"
    return {"cpu": cpu_model(), "machine": platform.machine(), "cpus": _cpus(),
            "flags": hashlib.sha256(" ".join(sorted(qmm.cpu_flags())).encode()).hexdigest()[:16],
            "mlx": version("mlx"), "justfit": justfit,
            "kernel": hashlib.sha256(qmm.SOURCE.read_bytes()).hexdigest()[:12]}  # an edited kernel re-measures


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def path():
    from ..config import home

    digest = hashlib.sha256(json.dumps(cache_key(), sort_keys=True).encode()).hexdigest()[:16]
    return home() / "tuning" / f"cpu-{digest}.json"


def choices() -> dict:
    """The measured choices (see the module doc), read from the cache or measured now and cached."""
    if _state["choices"] is None:
        with _lock:
            if _state["choices"] is None:
                _state["choices"] = _read_or_measure()
    return _state["choices"]


def _read_or_measure() -> dict:
    from ..atomic import atomic_write

    p = path()
    try:
        got = json.loads(p.read_text())
        if got.get("key") == cache_key():
            return got
    except (OSError, ValueError):
        pass
    got = measure()
    try:
        atomic_write(p, json.dumps(got, indent=1))
    except OSError:  # a read-only home: measured again next process
        pass
    return got


def _time(fn, *args) -> float:
    """Median microseconds of fn(*args) over REPS runs, after one warm-up."""
    fn(*args)
    out = []
    for _ in range(REPS):
        t = time.perf_counter()
        fn(*args)
        out.append(time.perf_counter() - t)
    return 1e6 * statistics.median(out)


def _product(x, w):
    import mlx.core as mx

    mx.eval(x @ w)


def _kernel(x, weights, variant, threads):
    import mlx.core as mx

    mx.eval(qmm.matmul(x, weights, variant, threads))


def _dequantized_product(x, w, s, b):
    import mlx.core as mx

    mx.eval(x @ mx.dequantize(w, s, b, group_size=64, bits=4).T)


def _kernel_rows(weights, variant, threads, us) -> int:
    """The most rows (16, 32 or 64) for which the kernel beats dequantize + BLAS on the timed weight."""
    import mlx.core as mx

    rows = 16
    for m in (32, 64):
        x = mx.random.normal((m, weights[0][0].shape[1] * 8), key=mx.random.key(m))
        us[f"qmm {m} rows"] = _time(_kernel, x, weights, variant, threads)
        us[f"dequantize+BLAS {m} rows"] = _time(_dequantized_product, x, *weights[0][:3])
        if us[f"qmm {m} rows"] >= us[f"dequantize+BLAS {m} rows"]:
            break
        rows = m
    return rows


def measure() -> dict:
    """Time every choice now (a few hundred ms on a 2-core x86-64 machine)."""
    import mlx.core as mx

    t0 = time.perf_counter()
    out = {"key": cache_key(), "variant": 0, "threads": 1, "quantized": False, "row_major": False, "kernel_rows": 16,
           "us": {}}
    if mx.default_device() != mx.cpu:
        return out
    n, k = SHAPE
    w = mx.random.normal((n, k), key=mx.random.key(0))
    x = mx.random.normal((1, k), key=mx.random.key(1))
    wt = mx.contiguous(w.T)
    mx.eval(w, x, wt)
    us = out["us"]
    us["fp32 x@W.T"] = _time(_product, x, w.T)
    us["fp32 x@W"] = _time(_product, x, wt)
    out["row_major"] = us["fp32 x@W"] < us["fp32 x@W.T"]
    del wt
    if qmm.available():
        q = mx.quantize(w, group_size=64, bits=4)
        mx.eval(*q)
        del w
        weights = [(*q, 64, 4)]
        best = None
        for v in qmm.runnable_variants():
            for th in sorted({1, 2, min(4, _cpus()), _cpus()} & set(range(1, min(_cpus(), 16) + 1))):
                t = _time(_kernel, x, weights, v, th)
                us[f"qmm {qmm.VARIANT_NAMES[v]} {th}t"] = t
                if best is None or t < best[0]:
                    best = (t, v, th)
        out["variant"], out["threads"] = best[1], best[2]
        out["quantized"] = best[0] < min(us["fp32 x@W.T"], us["fp32 x@W"])
        out["kernel_rows"] = _kernel_rows(weights, best[1], best[2], us)
    out["us"] = {k: round(v, 1) for k, v in us.items()}
    out["measured_s"] = round(time.perf_counter() - t0, 3)
    return out


def describe() -> str:
    """One line for `justfit info`: the choices and where they are cached."""
    c = choices()
    if not c.get("variant"):
        kernel = f"kernel off ({qmm.status()})" if not qmm.available() else "kernel off"
    else:
        kernel = (f"kernel {qmm.VARIANT_NAMES[c['variant']]} x{c['threads']} threads up to "
                  f"{c.get('kernel_rows', 16)} rows")
    return (f"{kernel}, {'4-bit + kernel' if c['quantized'] else 'float32'} weights faster, "
            f"float32 layout {'row-major' if c['row_major'] else 'as stored'} (measured in {c.get('measured_s', 0)} s; {path()})")


def reset():
    """Forget the in-process answer (tests; the file stays)."""
    _state["choices"] = None
