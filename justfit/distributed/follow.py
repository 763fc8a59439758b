"""Rank 0 decides each request, the other ranks follow: for fronts (the HTTP server) that only rank 0 sees.

Rank 0 calls `lead(tokens, max_tokens, ...)` right before its own `rt.generate(tokens, ...)`; every other
rank sits in `follow(rt)`, which receives the same request (one all_sum broadcast of ints) and runs the
same generate, so the collectives inside the model line up step for step. `lead_stop()` ends the followers.
"""

from typing import List, Optional

from .world import World, broadcast_ints, world

SCALE = 1_000_000  # floats travel as fixed-point ints


def _encode(tokens: List[int], max_tokens: int, temperature: float, seed: Optional[int], top_p: float) -> List[int]:
    return [max_tokens, round(temperature * SCALE), -1 if seed is None else seed, round(top_p * SCALE), *tokens]


def lead(tokens: List[int], max_tokens: int, temperature: float = 0.0, seed: Optional[int] = None,
         top_p: float = 1.0, w: Optional[World] = None) -> None:
    """Rank 0: announce the next request to the followers (no-op on one rank)."""
    w = w or world()
    if w.size > 1:
        broadcast_ints(_encode(list(tokens), max_tokens, temperature, seed, top_p), w)


def lead_stop(w: Optional[World] = None) -> None:
    """Rank 0: tell the followers to return from follow()."""
    w = w or world()
    if w.size > 1:
        broadcast_ints([0], w)


def follow(rt, w: Optional[World] = None) -> int:
    """Ranks > 0: run every request rank 0 announces until lead_stop(); returns how many ran."""
    w = w or world()
    n = 0
    while True:
        msg = broadcast_ints(None, w)
        if msg[0] == 0:
            return n
        max_tokens, temp, seed, top_p, tokens = msg[0], msg[1] / SCALE, msg[2], msg[3] / SCALE, msg[4:]
        rt.generate(tokens, max_tokens=max_tokens, temperature=temp, seed=None if seed < 0 else seed, top_p=top_p)
        n += 1
