"""How many prefill rows a step that also decodes may carry, from the step times the engine measures.

Every forward pass pays a fixed cost (reading the weights, dispatching each layer's ops) besides a cost per
row. A prefill cut into chunks of R rows pays the fixed cost once per chunk, so its overhead is about
fixed / (R x per_row). A fixed cap tuned on one model is wrong for another (a wide model's steps cost far
more beside their rows than the default model's: docs/benchmarks.md has the measurements), and on one
machine for another. So the cap is the floor (`PREFILL_WITH_DECODE`, engine/scheduler.py) or the rows that
keep the fixed cost at most 1/`OVERHEAD_RATIO` of a chunk's, whichever is more, within the step's rows; a
long prefill still stalls the decoders for one chunk a step, never more.
"""

from collections import deque
from typing import Optional, Tuple

OVERHEAD_RATIO = 8  # a mixed step's prefill rows cost at least this many times the step's fixed cost
SAMPLES = 32  # recent synchronous steps the fit uses
ROUND = 32  # the cap moves in steps of this many rows (few distinct shapes to build)


class ChunkSizer:
    """A line fit (seconds = fixed + per_row x rows) over recent steps' sizes and wall times, and the
    prefill rows per decoding step it implies."""

    def __init__(self, floor: int, ceiling: int, adaptive: bool = True, consensus=None):
        self.floor, self.ceiling, self.adaptive = floor, max(floor, ceiling), adaptive
        self.consensus = consensus  # the engine's Consensus: under mlx.launch rank 0's rows stand
        self.samples: deque = deque(maxlen=SAMPLES)  # (rows, seconds) of steps computed while the engine waited

    def observe(self, rows: int, seconds: float):
        """Record one step computed synchronously (a queued step's time overlaps the previous one: skip it)."""
        if rows > 0 and seconds > 0:
            self.samples.append((rows, seconds))

    def fit(self) -> Optional[Tuple[float, float]]:
        """(fixed seconds a step, seconds a row), or None until the samples span rows enough to tell them apart
        (the largest step at least twice the smallest) and the fit is physical (both positive)."""
        xs = [x for x, _ in self.samples]
        if len(xs) < 3 or max(xs) < 2 * min(xs):
            return None
        n = len(xs)
        mx_, my = sum(xs) / n, sum(y for _, y in self.samples) / n
        sxx = sum((x - mx_) ** 2 for x in xs)
        per_row = sum((x - mx_) * (y - my) for x, y in self.samples) / sxx
        fixed = my - per_row * mx_
        if per_row <= 0 or fixed <= 0:
            return None
        return fixed, per_row

    def rows(self) -> int:
        """Prefill rows a step that also decodes may carry (agreed with the other ranks, if any)."""
        rows = self._rows()
        return self.consensus.agree(rows) if self.consensus is not None else rows

    def _rows(self) -> int:
        fit = self.fit() if self.adaptive else None
        if fit is None:
            return self.floor
        fixed, per_row = fit
        want = -(-int(OVERHEAD_RATIO * fixed / per_row) // ROUND) * ROUND
        return max(self.floor, min(self.ceiling, want))
