"""A/B: the scheduler at concurrency 1 with the lone request in single-sequence KV mode (the default since
session 12: float window, float32 open page) vs forced into batched mode (for_batch from its first write, as
before), vs mlx-lm's BatchGenerator; rounds interleaved, rotating order, one fresh prompt per round.
(session 12, 5 rounds, 512-token prompts, 64 tokens, paired ratio vs mlx-lm: single mode 1.10x / 1.03x,
forced batched 0.93x / 0.91x; peak over start 81 vs 39 MiB, mlx-lm 52)

Run: python docs/bench/repro/ab_lone_request_mode.py 5 512 64
"""
import random
import statistics
import sys
import tempfile
from pathlib import Path

import justfit  # noqa: F401,I001  (before mlx: justfit loads OpenBLAS)
import justfit.kvexec as kvexec
from justfit.bench import batch as B
from justfit.config import KVConfig

rounds, prompt_tokens, gen = (int(x) for x in sys.argv[1:4])
model, tok = B._load("default", 0)
kv, real = KVConfig(), kvexec.make_cache


def batched_cache(*a, **k):
    caches = real(*a, **k)
    for c in caches:
        c.for_batch()
    return caches


res = {n: [] for n in ("single-mode", "forced-batched", "mlx-lm")}
rng = random.Random(1)
with tempfile.TemporaryDirectory() as tmp:
    warm = B._prompts(rng, 1, 64, 32, 49152)
    B.run_justfit(model, tok, kv, Path(tmp) / "w", warm, 4)
    B.run_mlx_lm(model, warm, 4)
    for i in range(rounds):
        prompts = B._prompts(rng, 1, prompt_tokens, prompt_tokens // 2, 49152)
        names = list(res)[i % 3:] + list(res)[: i % 3]
        for n in names:
            if n == "mlx-lm":
                r = B.run_mlx_lm(model, prompts, gen)
            else:
                kvexec.make_cache = batched_cache if n == "forced-batched" else real
                r = B.run_justfit(model, tok, kv, Path(tmp) / f"{n}{i}", prompts, gen)
                kvexec.make_cache = real
            res[n].append(r)
for n, rs in res.items():
    t = [r["throughput_tok_s"] for r in rs]
    print(f"{n}: {statistics.median(t):.2f} tok/s [{min(t):.2f}-{max(t):.2f}], ITL p50 "
          f"{statistics.median(r['itl_p50_s'] for r in rs) * 1e3:.1f} ms, peak over start "
          f"{statistics.median(r['peak_over_start_bytes'] for r in rs) / 2**20:.0f} MiB", end="")
    if n != "mlx-lm":
        print(f", paired ratio vs mlx-lm {statistics.median(a['throughput_tok_s'] / b['throughput_tok_s'] for a, b in zip(rs, res['mlx-lm'])):.3f}x")
    else:
        print()
