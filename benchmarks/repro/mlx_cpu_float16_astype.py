"""Minimal reproduction: on MLX's CPU backend, widening float16 to float32 (`astype`) is several times slower than
widening bfloat16, and narrowing float32 to float16 slower still; why KVExec stores 16-bit pages as bfloat16 on CPU.

Run: python benchmarks/repro/mlx_cpu_float16_astype.py
Measured results: docs/benchmarks.md.
"""

import statistics
import time

import mlx.core as mx


def median_us(f, n=200):
    """Median wall time of n evaluated calls, in microseconds (5 warm-up calls first)."""
    for _ in range(5):
        mx.eval(f())
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        mx.eval(f())
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs) * 1e6


def main():
    x = mx.random.normal((24, 256, 64))
    h, b = x.astype(mx.float16), x.astype(mx.bfloat16)
    mx.eval(x, h, b)
    rows = [("float16 -> float32", lambda: h.astype(mx.float32)),
            ("bfloat16 -> float32", lambda: b.astype(mx.float32)),
            ("float32 -> float16", lambda: x.astype(mx.float16)),
            ("float32 -> bfloat16", lambda: x.astype(mx.bfloat16)),
            ("float32 copy (x * 1)", lambda: x * 1.0)]
    print(f"MLX {mx.__version__}, {x.size:,} elements")
    for name, f in rows:
        print(f"{name:22s} {median_us(f):8.0f} us")


if __name__ == "__main__":
    main()
