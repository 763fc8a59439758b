"""A/B of the decode loop at chat length: token_steps now (overlapped steps) vs token_steps at a base revision
(each token read before the next step is built) vs mlx-lm's generate_step; plain greedy, no drafter, the
default model and default KV (nothing is sealed at this length). Median per-token interval of each
run, runs interleaved; tok/s over the run.

Run: python docs/bench/repro/chat_overlap_ab.py 128 8 7bb1dc1
"""
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import justfit  # noqa: I001  (before mlx: justfit loads OpenBLAS)
import justfit.generation as G
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

N, R, base = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
src = subprocess.run(["git", "show", f"{base}:justfit/generation.py"], capture_output=True, text=True, check=True).stdout
path = Path(tempfile.mkdtemp()) / "generation_base.py"
path.write_text(src)
spec = importlib.util.spec_from_file_location("justfit.generation_base", path)
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
rt = justfit.Runtime("default", drafter="none")
ids = rt.encode("Write a long essay about the history of bridges, their engineering and the people who built them.")


def run(name):
    ts = []
    if name == "mlx-lm":
        steps = generate_step(mx.array(ids), rt.model, max_tokens=N, prompt_cache=make_prompt_cache(rt.model))
    else:
        loop = G.token_steps if name == "now" else old.token_steps
        steps = loop(rt.model, ids, rt.make_cache(), G.Sampling(), N)
    for _ in steps:
        ts.append(time.perf_counter())
    gaps = [b - a for a, b in zip(ts[1:], ts[2:])]
    return len(gaps) / (ts[-1] - ts[1]), statistics.median(gaps) * 1000


names = ["now", base, "mlx-lm"]
for n in names:
    run(n)
res = {n: [] for n in names}
for r in range(R):
    for n in names[r % 3:] + names[:r % 3]:
        res[n].append(run(n))
for n in names:
    tps, gap = [x[0] for x in res[n]], [x[1] for x in res[n]]
    print(f"{n}: {statistics.median(tps):.2f} tok/s ({min(tps):.2f}-{max(tps):.2f}); "
          f"median interval {statistics.median(gap):.1f} ms ({min(gap):.1f}-{max(gap):.1f})")
