"""Why test_a_lone_request_keeps_single_sequence_mode_until_another_joins failed for some prompts (session 13
took it for a hazard of its batched-decode changes and reverted them). The test's logic on fixed-seed prompt
tags, checked against two references: a lone run that never switches to batched mode (the old test), and one
whose caches switch (`for_batch`) at the token where the scheduler switched them (the test since session 14).
Prints each failing seed with the never-switched run's top-2 logit gap at the first differing token.
(session 14, seeds 0-39: never-switched fails seeds 6, 8, 20 at token 7, gaps 0.064 / 0.007 / 0.017, on
d069e98's code and on 11c8bc3's alike; switched: 0 of 60 on both)

Run: python docs/bench/repro/lone_request_near_tie.py 0 40
"""
import random
import sys
from pathlib import Path

import justfit
import mlx.core as mx

from justfit.config import KVConfig
from justfit.kvexec import PagedKVCache, make_cache
from justfit.scheduler import Engine

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from scheduler_support import greedy_alone  # noqa: E402

rt = justfit.Runtime(kv=KVConfig(bits=16, page_size=32))  # the default model (its engines here use no prefix store)
kv = KVConfig(page_size=32, quantized_kv_start=32)
switched, for_batch = {}, PagedKVCache.for_batch
PagedKVCache.for_batch = lambda c: (switched.setdefault(id(c), c.offset), for_batch(c))[1]


def gap(ids, tokens):
    """Top-2 logit gap of the never-switched lone run where it first differs from `tokens`."""
    c = make_cache(rt.model, kv)
    logits = rt.model(mx.array(ids)[None], cache=c)[0, -1]
    for t in tokens:
        top = mx.sort(logits)[-2:].tolist()
        if int(mx.argmax(logits)) != t:
            return round(top[1] - top[0], 4)
        logits = rt.model(mx.array([[t]]), cache=c)[0, -1]
    return None


fails = {"never switched": [], "switched": []}
first, last = int(sys.argv[1]), int(sys.argv[2])
for seed in range(first, last):
    tag = "%032x" % random.Random(seed).getrandbits(128)
    ids = [rt.encode(f"[{tag}{i}] " + f"Lighthouse keeper's note {i}: the lamp was trimmed, the fog came in. " * 2)
           for i in range(2)]
    switched.clear()
    eng = Engine(rt.model, rt.tokenizer, lambda: make_cache(rt.model, kv), kv=kv)
    a = eng.submit(ids[0], max_tokens=12)
    while len(a.out) < 4:
        eng.step()
    b = eng.submit(ids[1], max_tokens=6)
    while b.caches is None:
        eng.step()
    at = [switched[id(r.caches[0])] for r in (a, b)]
    while not (a.done and b.done):
        eng.step()
    got = [r.result().tokens for r in (a, b)]
    if got != [greedy_alone(rt, ids[0], 12, kv), greedy_alone(rt, ids[1], 6, kv)]:
        fails["never switched"].append((seed, gap(ids[0], got[0])))
    if got != [greedy_alone(rt, ids[0], 12, kv, batched_from=at[0]), greedy_alone(rt, ids[1], 6, kv, batched_from=at[1])]:
        fails["switched"].append(seed)
for name, f in fails.items():
    print(f"{name}: {len(f)} of {last - first} seeds fail: {f}")
