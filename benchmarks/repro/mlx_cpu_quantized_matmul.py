"""Minimal reproduction: on MLX's CPU backend, 4-bit `quantized_matmul` at decode-attention shapes is several times
slower than a float32 matmul on the same data, although it reads ~7x fewer bytes (what bounds KVExec decode).

Run: LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python benchmarks/repro/mlx_cpu_quantized_matmul.py
Measured results: docs/benchmarks.md.
"""

import statistics
import time

import mlx.core as mx


def median_us(f, n=300):
    """Median wall time of n evaluated calls, in microseconds (10 warm-up calls first)."""
    for _ in range(10):
        mx.eval(f())
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        mx.eval(f())
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs) * 1e6


def row(T: int) -> str:
    """Float32 vs 4-bit times for one layer at T cached tokens (3 KV heads, head_dim 64, 3 queries per head)."""
    v = mx.random.normal((3, T, 64))
    p = mx.softmax(mx.random.normal((3, 3, T)), axis=-1)
    q = mx.random.normal((3, 3, 64))
    w, s, b = mx.quantize(v, group_size=64, bits=4)
    mx.eval(v, p, q, w, s, b)
    pv = median_us(lambda: p @ v)
    pv4 = median_us(lambda: mx.quantized_matmul(p, w, s, b, transpose=False))
    qk = median_us(lambda: q @ v.swapaxes(-1, -2))
    qk4 = median_us(lambda: mx.quantized_matmul(q, w, s, b, transpose=True))
    return f"T={T}: p@V float32 {pv:.0f} us, 4-bit {pv4:.0f} us | q@K^T float32 {qk:.0f} us, 4-bit {qk4:.0f} us"


def main():
    for T in (2048, 16384):
        print(row(T))


if __name__ == "__main__":
    main()
