"""Which steps make batching's ITL tail at 4k-token prompts: each step's decoders, prefill rows, the chunk cap
(scheduler_chunks.ChunkSizer) with its line fit (fixed s, s a row), and seconds.
Session 17, `4 4096 16` (default model, 1,024 shared tokens): ITL p50 1.83 s, p99 = max 12.18 s, which is the one
step whose cap rose to 448 rows (fit 0.55 s + 0.0103 s a row predicts 5.2 s; it took 12.2 s). The fit's "fixed"
grew from 0.03 to 0.58 s as decoders and deeper prompt rows joined, and its cost per row, fitted on shallower
chunks, misses that a row's attention grows with its depth in a 4k prompt.
Session 18, same command, one run each: this code (b8e3d87) wall 188.8 s, ITL p50 1.67 s, p99 7.26 s; a fit over
fixed + rows + keys with the chunk solved at its depth (865909d) 188.3 s, 5.16 / 11.81 s; that fit as non-negative
least squares needing 3 steps each side of half the largest (uncommitted) 192.8 s, 5.00 / 10.29 s. The keys fit is
right about depth, but it also fits a mixed step's fixed cost at 0.6-1.6 s here, so the overhead rule asks for
~5 s steps from the first mixed step on; reverted (see the session 18 note).

Run: python docs/bench/repro/batch_itl_4k_steps.py 4 4096 16   (concurrency, prompt tokens, generated tokens)
"""
import random
import sys
import tempfile
import time

from pathlib import Path
import justfit  # noqa: F401  (before mlx: OpenBLAS)
from justfit.config import KVConfig
from justfit.models import load
from justfit.kvexec import make_cache
from justfit.scheduler import Engine
from justfit.statetrans.index import make_index
from justfit.bench.batch import _prompts
from justfit.bench.stats import percentile

conc, ptok, gen = (int(x) for x in sys.argv[1:4])
model, tok = load("default")
kv = KVConfig()
rng = random.Random(1)
prompts = _prompts(rng, conc, ptok, 1024, int(model.args.vocab_size))
home = Path(tempfile.mkdtemp())
index = make_index(model, tok, kv, home)
eng = Engine(model, tok, lambda: make_cache(model, kv, pool=index.pool), index=index, kv=kv, eos=set())
reqs = [eng.submit(p, max_tokens=gen) for p in prompts]
log, caps = [], [None]
orig_assemble, orig_rows = eng._assemble, eng.chunks.rows
def rows(*args):
    caps[0] = orig_rows(*args)  # the cap the engine asked for in this step
    return caps[0]
def assemble():
    caps[0] = None
    plan = orig_assemble()
    log.append((sum(1 for r, n in plan if n == 1), sum(n for r, n in plan if n > 1), caps[0], eng.chunks.fit()))
    return plan
eng._assemble, eng.chunks.rows = assemble, rows
t = time.perf_counter()
while not eng.idle():
    t0 = time.perf_counter()
    eng.step()
    dt = time.perf_counter() - t0
    if log and len(log[-1]) == 4:
        log[-1] = log[-1] + (dt,)
print("wall", time.perf_counter() - t)
for i, e in enumerate(log):
    if len(e) == 5 and (e[1] > 0 or e[4] > 1.0):
        fit = e[3] and tuple(float("%.3g" % x) for x in e[3])
        print(f"step {i}: decoders {e[0]} prefill rows {e[1]} cap {e[2]} fit {fit} {e[4]:.2f}s")
itl = [b - a for r in reqs for a, b in zip(r.token_times, r.token_times[1:])]
print("itl p50 %.2f p99 %.2f max %.2f" % (percentile(itl, 0.5), percentile(itl, 0.99), percentile(itl, 1.0)))  # bench batch's percentiles
print("last samples:", list(eng.chunks.samples)[-12:])
