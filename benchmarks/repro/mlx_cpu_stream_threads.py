"""Minimal reproduction: MLX's CPU backend runs each stream's ops on one thread, so a chain of non-BLAS ops
(quantized_matmul, softmax) uses one core however many the machine has; the same work split across two streams
takes half the time. (Why KVExec splits a long block's pages across streams: kvexec/streams.py.)

Run: python benchmarks/repro/mlx_cpu_stream_threads.py
Measured results: docs/benchmarks.md.
"""

import time

import mlx.core as mx

H, REP, D, T = 3, 3, 64, 16384
q = mx.random.normal((H, REP, D))
kw, ks, kb = mx.quantize(mx.random.normal((H, T, D)), group_size=64, bits=4)
vw, vs, vb = mx.quantize(mx.random.normal((H, T, D)), group_size=64, bits=4)
mx.eval(q, kw, ks, kb, vw, vs, vb)
second = mx.new_stream(mx.cpu)


def part(sl, stream=None):
    s = mx.quantized_matmul(q, kw[:, sl], ks[:, sl], kb[:, sl], transpose=True, group_size=64, bits=4, stream=stream)
    p = mx.softmax(s, axis=-1, stream=stream)
    return mx.quantized_matmul(p, vw[:, sl], vs[:, sl], vb[:, sl], transpose=False, group_size=64, bits=4, stream=stream)


def median_ms(f, n=20):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        mx.eval(f())
        ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2] * 1e3


one = median_ms(lambda: part(slice(0, T)))
two = median_ms(lambda: part(slice(0, T // 2)) + part(slice(T // 2, T), stream=second))
print(f"one stream {one:.1f} ms, two streams {two:.1f} ms (not the same softmax: a timing repro only)")
