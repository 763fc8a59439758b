"""Wall-clock throughput of one batch workload with the prefill rows next to decoders fixed at given caps, or
sized from measured steps (the default, scheduler_chunks.py), against mlx-lm's BatchGenerator on the same
prompts (bench batch's workload: c prompts of 512 tokens sharing a 256-token prefix, `gen` greedy tokens each).
Caps: comma-separated, 0 = mlx-lm, -1 = the measured default. One line a system per round; rounds interleave.
(session 15, wide model, c=16, gen 32, one round: cap 128 6.55, 256 7.54, 512 8.59 tok/s, mlx-lm 8.45; the
measured default fitted 0.52 s a step + 8.9 ms a row and chose 416-512 rows: 8.32 vs mlx-lm 8.43)

Run: python docs/bench/repro/prefill_chunk_cap.py 128,512,-1,0 16 wide 32 1
"""
import random
import sys
import tempfile
import time

import justfit  # noqa: F401,I001  (before mlx: justfit loads OpenBLAS)

from justfit.bench import batch as B
from justfit.config import KVConfig
from justfit.kvexec import make_cache
from justfit.scheduler import Engine
from justfit.statetrans.index import make_index

caps = [int(x) for x in sys.argv[1].split(",")]
c, wide = int(sys.argv[2]), sys.argv[3] == "wide"
gen, rounds = int(sys.argv[4]), int(sys.argv[5])
model, tok = B._load("default", 2 if wide else 0)
kv = KVConfig()
rng = random.Random(11)


def justfit_run(prompts, cap):
    index = make_index(model, tok, kv, tempfile.mkdtemp())
    eng = Engine(model, tok, lambda: make_cache(model, kv, pool=index.pool), index=index, kv=kv, eos=set(),
                 prefill_with_decode=None if cap < 0 else cap)
    t0 = time.perf_counter()
    reqs = [eng.submit(p, max_tokens=gen) for p in prompts]
    eng.run(reqs)
    wall = time.perf_counter() - t0
    fit = eng.chunks.fit()
    note = f" (fit {fit[0]:.2f} s + {fit[1] * 1e3:.1f} ms a row: {eng.chunks.rows()} rows)" if cap < 0 and fit else ""
    return sum(len(r.out) for r in reqs) / wall, wall, note


for r in range(rounds):
    prompts = B._prompts(rng, c, 512, 256, 40000)
    for cap in (caps if r % 2 == 0 else caps[::-1]):
        if cap == 0:
            row = B.run_mlx_lm(model, prompts, gen)
            tps, wall, name, note = row["throughput_tok_s"], row["wall_s"], "mlx-lm", ""
        else:
            tps, wall, note = justfit_run(prompts, cap)
            name = "measured" if cap < 0 else f"cap {cap}"
        print(f"round {r} {name}: {tps:.2f} tok/s, wall {wall:.1f} s{note}", flush=True)
