"""kvexec/batch.forward on one batched prefill pass (4 sequences x 128 prompt rows): the last layer's attention and MLP
for the sampled rows only (_sampled_hidden, landed in session 17) vs one plain pass over every row; medians of
interleaved rounds. Session 17: wide 2-layer model (argument 2), 5 rounds: full 4380 ms (3893-4525), split 2463
(2184-2897); default 30-layer model (argument 0), 9 rounds: full 2050 (1854-2220), split 2023 (1851-2252).

Run: python docs/bench/repro/batch_last_layer_ab.py 2 5   (layers of the wide model, 0: the default model; rounds)
"""
import statistics
import sys
import time

import justfit  # noqa: F401  (before mlx: OpenBLAS)
import mlx.core as mx
from justfit.config import KVConfig
from justfit.kvexec import make_cache, route
from justfit.kvexec import batch as bm
from justfit.bench.batch import wide_model
from justfit.models import load

layers = int(sys.argv[1]) if len(sys.argv) > 1 else 2
_, tok = load("default")
model = wide_model(layers, 49152) if layers else load("default")[0]
mx.eval(model.parameters())
route(model)
kv = KVConfig()
orig = bm._sampled_hidden
def full(inner, plan, inputs, rows):
    return inner(inputs, cache=plan.layers)[rows]
def one(split, segs=4, n=128):
    bm._sampled_hidden = orig if split else full
    caches = [make_cache(model, kv) for _ in range(segs)]
    for cs in caches:
        for c in cs:
            c.for_batch()
    ids = list(range(1000, 1000 + segs * n))
    t = time.perf_counter()
    out = bm.forward(model, bm.BatchPlan([(c, n) for c in caches]), ids)
    mx.eval(out, [c.state for cs in caches for c in cs])
    return time.perf_counter() - t
one(True)
one(False)
res = {True: [], False: []}
for r in range(int(sys.argv[2]) if len(sys.argv) > 2 else 9):
    for s in ((True, False) if r % 2 else (False, True)):
        res[s].append(one(s))
for s in (False, True):
    xs = res[s]
    print(f"{'split' if s else 'full '} median {statistics.median(xs)*1e3:.0f} ms min {min(xs)*1e3:.0f} max {max(xs)*1e3:.0f}")
