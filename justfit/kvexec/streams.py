"""Parallel attention on the CPU: one layer's keys split across MLX streams, one CPU thread each.

MLX runs every CPU op of a stream on that stream's one thread, so paged attention on the CPU used one core
while the model's BLAS matmuls used all of them; mlx-lm's float attention reaches BLAS too. Splitting a
block's visible pages into a few token-balanced parts, each scored on its own stream and merged with the
softmax merge (softmax.Online.merge), puts the idle cores to work (benchmarks/repro/mlx_cpu_stream_threads.py
shows the effect). Short blocks stay on one stream: a split adds ~10 ops, which cost more than they save there.
"""

import contextlib
import os
from typing import List

import mlx.core as mx

SPLIT_ELEMENTS = 5 << 10  # least work (heads x query rows x keys) per part worth a stream: ~1.1k keys at 9 heads
MAX_PARTS = min(4, os.cpu_count() or 1)  # one part per core, at most 4 (each adds its merge)

_streams: dict = {}


def parts(elements: int) -> int:
    """How many streams a block of this much work (heads x query rows x keys) is split across."""
    if MAX_PARTS < 2 or mx.default_device() != mx.cpu:
        return 1
    return max(1, min(MAX_PARTS, elements // SPLIT_ELEMENTS))


def merged(groups: List[list], attend):
    """attend(i, group) -> softmax state for each group, each on its own stream, merged into one state
    (softmax.Online.merge); the caller finishes it."""
    state = None
    for i, group in enumerate(groups):
        with on(i):
            s = attend(i, group)
        state = s if state is None else state.merge(s)
    return state


def on(i: int):
    """Context in which part i's ops run: the default stream for part 0, a stream of its own for the rest."""
    if i == 0:
        return contextlib.nullcontext()
    if i not in _streams:  # one per thread where MLX's streams belong to the thread that made them
        _streams[i] = getattr(mx, "new_thread_local_stream", mx.new_stream)(mx.cpu)
    return mx.stream(_streams[i])


def balanced(items: list, sizes: List[int], n: int) -> List[list]:
    """items cut into at most n consecutive groups of about equal total size (none empty)."""
    total, groups, acc = sum(sizes), [[]], 0
    for item, size in zip(items, sizes):
        if groups[-1] and acc >= total * len(groups) / n and len(groups) < n:
            groups.append([])
        groups[-1].append(item)
        acc += size
    return groups
