"""Graph nodes (MLX ops) of one batched decode step: B sequences of T tokens on the default model (4-bit pages,
for_batch, as the scheduler runs them) vs mlx-lm's BatchKVCache, by primitive (mx.export_to_dot). On the
2-core CPU an op costs ~5-10 us to dispatch, so at short contexts the count bounds the step as much as bytes.
(B=4, T=600: 9,291 nodes on d069e98's code, 7,501 with 1970fa0/11c8bc3 (re-landed in session 14: their
revert was a test's near-tie, not a hazard); mlx-lm 4,379. Attention 95 nodes a layer (two streams), KV writes 14.)

Run: python docs/bench/repro/batch_decode_nodes.py 4 600
"""
import collections
import random
import re
import sys
import tempfile

import justfit  # noqa: F401,I001  (before mlx: justfit loads OpenBLAS)
import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from justfit.bench import batch as B
from justfit.config import KVConfig
from justfit.kvexec import make_cache
from justfit.kvexec.batch import BatchPlan, _decode_batch, forward


def count(arrays):
    """(total nodes, the most common primitives) of the graph behind arrays."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *arrays)
        c = collections.Counter(re.findall(r'label ="?([A-Za-z]+)', f.read()))
    return sum(c.values()), c.most_common(10)


n_seqs, ctx = (int(x) for x in sys.argv[1:3])
model, _ = B._load("default", 0)
rng = random.Random(0)
prompts = [[rng.randrange(1000, 49000) for _ in range(ctx)] for _ in range(n_seqs)]
seqs = []
for ids in prompts:
    c = make_cache(model, KVConfig())
    for layer in c:
        layer.for_batch()
    c[0].seq.reserve(ctx)
    mx.eval(forward(model, BatchPlan([(c, ctx)]), ids))
    seqs.append(c)
memo = {}
for c in seqs:
    c[0].seq.reserve(ctx + 1)
mx.eval(forward(model, BatchPlan([(c, 1) for c in seqs], memo), [42] * n_seqs))  # the memo is built
for c in seqs:
    for layer in c:
        layer.trim(1)
    c[0].seq.reserve(ctx + 1)
plan = BatchPlan([(c, 1) for c in seqs], memo)
out = forward(model, plan, [42] * n_seqs)
print("justfit step", count([out] + [a for c in seqs for layer in c for a in layer.state]))
theirs = [BatchKVCache([0] * n_seqs) for _ in model.layers]
mx.eval(model(mx.array(prompts), cache=theirs))
lo = model(mx.array([[42]] * n_seqs), cache=theirs)
print("mlx-lm step", count([lo] + [a for layer in theirs for a in layer.state if isinstance(a, mx.array)]))
q = mx.random.normal((n_seqs, 9, 64))
mx.eval(q, out, lo, [a for c in seqs for layer in c for a in layer.state])
print("justfit attention, one layer", count([_decode_batch(q, [c[3] for c in seqs], 0.125, memo)]))
