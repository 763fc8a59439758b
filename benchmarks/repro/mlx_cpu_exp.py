"""Minimal reproduction: on MLX's CPU backend `mx.exp` costs several times a degree-6 polynomial fused by
`mx.compile`; softmax and `scaled_dot_product_attention` are bound by it. Separately, any elementwise op on an array
above glibc's 32 MB mmap ceiling pays page faults on every call (compare with MALLOC_MMAP_THRESHOLD_ raised).

Run: python benchmarks/repro/mlx_cpu_exp.py
     MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=17179869184 python benchmarks/repro/mlx_cpu_exp.py
Measured results: docs/benchmarks.md.
"""

import time

import mlx.core as mx


def poly_exp(x):
    """e^x for x <= 0: 2^n times a degree-6 polynomial, 0 below -87."""
    y = mx.maximum(x, -87.0)
    n = mx.floor(y * 1.4426950408889634 + 0.5)
    r = y - n * 0.6931471805599453
    p = 1.0 + r * (1.0 + r * (0.5 + r * (1 / 6 + r * (1 / 24 + r * (1 / 120 + r * (1 / 720))))))
    return mx.where(x < -87.0, 0.0, p * ((n.astype(mx.int32) + 127) << 23).view(mx.float32))


def median_ms(f, n=7):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        mx.eval(f())
        ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2] * 1e3


fused = mx.compile(poly_exp)
for T in (256, 4096):
    x = -mx.abs(mx.random.normal((3, 1536, T))) * 4
    mx.eval(x)
    print(f"[3, 1536, {T}]: exp {median_ms(lambda x=x: mx.exp(x)):.1f} ms, compiled polynomial "
          f"{median_ms(lambda x=x: fused(x)):.1f} ms, x * 1.5 {median_ms(lambda x=x: x * 1.5):.1f} ms")
