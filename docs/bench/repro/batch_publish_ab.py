"""A/B in the full scheduler, CPU kernel on: kernel-served decode steps publish their tokens as their pass ends
(session 21) vs queueing the next pass first (before: the kernel computes a pass while it is built, so the queued
pass ran before this step's tokens were read). Same `justfit bench batch` workload (prompts sharing
min(1024, P/2) tokens, 128 greedy tokens, all submitted at once); arms interleaved in each round, medians with
min-max of throughput, TTFT and ITL.

Run: python docs/bench/repro/batch_publish_ab.py 16,4 512 5
"""
import random
import statistics
import sys
import tempfile
from pathlib import Path

import justfit  # noqa: F401  (before mlx: justfit loads OpenBLAS)
import justfit.kvexec as kvexec
from justfit.bench import batch as B
from justfit.config import KVConfig

concs = [int(x) for x in sys.argv[1].split(",")]
P, rounds = int(sys.argv[2]), int(sys.argv[3])
model, tok = B._load("default", 0)
kv, rng, vocab = KVConfig(), random.Random(21), int(model.args.vocab_size)
serves = kvexec.kernel_serves
arms = {"publish-now": serves, "queued-before": lambda caches: False}
keys = ["throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s"]
with tempfile.TemporaryDirectory() as tmp:
    home = Path(tmp)
    B.run_justfit(model, tok, kv, home / "w", B._prompts(rng, 2, 64, 32, vocab), 4)
    for c in concs:
        res = {a: [] for a in arms}
        for i in range(rounds):
            prompts = B._prompts(rng, c, P, min(1024, P // 2), vocab)
            for a in list(arms)[i % 2:] + list(arms)[:i % 2]:
                kvexec.kernel_serves = arms[a]
                r = B.run_justfit(model, tok, kv, home / f"{a}{c}{i}", prompts, 128)
                res[a].append(r)
                print(f"c={c} round {i + 1} {a}: " + " ".join(f"{k} {r[k]:.3f}" for k in keys), flush=True)
        for a in arms:
            cells = []
            for k in keys:
                xs = [r[k] for r in res[a]]
                cells.append(f"{k} {statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})")
            print(f"SUMMARY c={c} p={P} {a}: " + ", ".join(cells), flush=True)
