"""One decode step at chat length (100 tokens in the cache, nothing sealed): graph-building time and evaluation
time, JustFit's paged cache vs mlx-lm's KVCache on the same model; the step's token is trimmed back after each
step, systems alternate, medians (min-max) after 5 warm-up steps.

Run: python benchmarks/repro/chat_step_profile.py 80
"""
import statistics
import sys
import time

import justfit  # noqa: I001  (before mlx: justfit loads OpenBLAS)
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

rt = justfit.Runtime("default", drafter="none")
model, ids = rt.model, list(range(1000, 1100))


def setup(kind):
    c = rt.make_cache() if kind == "justfit" else make_prompt_cache(model)
    model(mx.array(ids)[None], cache=c)
    mx.eval([x.state for x in c])
    return c


def step(c):
    t0 = time.perf_counter()
    y = mx.argmax(model(mx.array([[5]]), cache=c)[:, -1, :], axis=-1)
    t1 = time.perf_counter()
    mx.eval(y)
    t2 = time.perf_counter()
    for x in c:
        x.trim(1)
    return t1 - t0, t2 - t1


caches = {k: setup(k) for k in ("justfit", "mlx-lm")}
res = {k: [] for k in caches}
for r in range(int(sys.argv[1])):
    for k in (list(caches) if r % 2 else list(caches)[::-1]):
        res[k].append(step(caches[k]))
for k, v in res.items():
    b, e = [x[0] * 1e3 for x in v[5:]], [x[1] * 1e3 for x in v[5:]]
    print(f"{k}: build {statistics.median(b):.2f} ms ({min(b):.2f}-{max(b):.2f}), "
          f"eval {statistics.median(e):.2f} ms ({min(e):.2f}-{max(e):.2f})")
