"""A/B in the full scheduler: batched decode with the CPU kernel (the default) vs the dequantized float copies
of sealed 4-bit pages it replaced below 4,096 sealed tokens (JUSTFIT_CPU_KERNELS=0: the path the
kernel replaced at these sizes) vs mlx-lm's BatchGenerator, on `justfit bench batch`'s workload (prompts sharing
min(1024, P/2) tokens, 128 greedy tokens, all submitted at once); systems interleaved in each round, medians
with min-max.

Run: python benchmarks/repro/batch_kernel_vs_copies.py 16,4 512 3   [wide layers, e.g. 2, for the --wide model]
"""
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

import justfit  # noqa: F401  (before mlx: justfit loads OpenBLAS)
from justfit.bench import batch as B
from justfit.config import KVConfig

concs = [int(x) for x in sys.argv[1].split(",")]
P, rounds = int(sys.argv[2]), int(sys.argv[3])
wide = int(sys.argv[4]) if len(sys.argv) > 4 else 0
model, tok = B._load("default", wide)
kv, rng, vocab = KVConfig(), random.Random(1), int(model.args.vocab_size)
systems = ["kernel", "float-copies", "mlx-lm-batch"]
with tempfile.TemporaryDirectory() as tmp:
    home = Path(tmp)
    warm = B._prompts(rng, 2, 64, 32, vocab)
    B.run_justfit(model, tok, kv, home / "w", warm, 4)
    B.run_mlx_lm(model, warm, 4)
    for c in concs:
        res = {s: [] for s in systems}
        for i in range(rounds):
            prompts = B._prompts(rng, c, P, min(1024, P // 2), vocab)
            for s in systems[i % 3:] + systems[:i % 3]:
                if s == "mlx-lm-batch":
                    r = B.run_mlx_lm(model, prompts, 128)
                else:
                    os.environ["JUSTFIT_CPU_KERNELS"] = "1" if s == "kernel" else "0"
                    r = B.run_justfit(model, tok, kv, home / f"{s}{c}{i}", prompts, 128)
                res[s].append(r)
                print(f"c={c} round {i + 1} {s}: {r['throughput_tok_s']:.1f} tok/s itl p50 {r['itl_p50_s'] * 1e3:.0f} ms "
                      f"p99 {r['itl_p99_s'] * 1e3:.0f} ms peak {r['peak_memory_bytes'] / 2**20:.0f} MiB "
                      f"over-start {r['peak_over_start_bytes'] / 2**20:.0f} MiB", flush=True)
        for s in systems:
            t = [r["throughput_tok_s"] for r in res[s]]
            itl = [r["itl_p50_s"] * 1e3 for r in res[s]]
            pk = [r["peak_over_start_bytes"] / 2**20 for r in res[s]]
            print(f"SUMMARY c={c} p={P} {s}: {statistics.median(t):.1f} tok/s ({min(t):.1f}-{max(t):.1f}) "
                  f"itl p50 {statistics.median(itl):.0f} ms, peak over start {statistics.median(pk):.0f} MiB", flush=True)
