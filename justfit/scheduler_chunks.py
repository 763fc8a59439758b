"""How many prefill rows a step that also decodes may carry, from the step times the engine measures.

Every forward pass pays a fixed cost (reading the weights, dispatching each layer's ops) besides a cost per
row and a cost per key a row attends to. A prefill cut into chunks of R rows pays the step's other costs once
per chunk, so its overhead is about other / chunk. A fixed cap tuned on one model is wrong for another: on the
default 135M model a step costs ~0.1 s plus ~6.4 ms a row and 128 rows keep the overhead near 1/8; on a wide
model (7-8B layer shapes, 2 layers) a step costs ~0.5 s plus ~8.7 ms a row, and 128-row chunks ran at 0.78x
mlx-lm's throughput (c=16) where 512 reached 1.02x. So the cap is the floor (`PREFILL_WITH_DECODE`) or the
rows whose cost is `OVERHEAD_RATIO` times the rest of the step's, whichever is more, within the step's rows.
The cost per key matters deep in a long prompt: a fit by rows alone (session 17, 4k prompts) took a row at
depth 3.5k for one at depth 500, allowed 448 rows and stalled the decoders 12 s in one step, not the 5 s it
predicted; rows at depth now cost what their attention costs and the chunk shrinks as the prompt deepens.
"""

import math
from collections import deque
from typing import Optional, Tuple

import numpy as np

OVERHEAD_RATIO = 8  # a mixed step's prefill rows cost at least this many times the rest of the step
SAMPLES = 32  # recent synchronous steps the fit uses
ROUND = 32  # the cap moves in steps of this many rows (few distinct shapes to build)


def chunk_keys(start: int, rows: int) -> int:
    """Keys the rows start..start+rows-1 of one sequence attend to (each row its prefix and itself)."""
    return rows * start + rows * (rows + 1) // 2


class ChunkSizer:
    """A least-squares fit (seconds = fixed + per_row x rows + per_key x keys) over recent steps' sizes and
    wall times, and the prefill rows per decoding step it implies."""

    def __init__(self, floor: int, ceiling: int, adaptive: bool = True):
        self.floor, self.ceiling, self.adaptive = floor, max(floor, ceiling), adaptive
        self.samples: deque = deque(maxlen=SAMPLES)  # (rows, keys, seconds) of steps computed while the engine waited

    def observe(self, rows: int, seconds: float, keys: int = 0):
        """Record one step computed synchronously (a queued step's time overlaps the previous one: skip it)."""
        if rows > 0 and seconds > 0 and keys >= 0:
            self.samples.append((rows, keys, seconds))

    def fit(self) -> Optional[Tuple[float, float, float]]:
        """(fixed seconds a step, seconds a row, seconds a key), or None until the samples span rows enough to
        tell the costs apart (the largest step at least twice the smallest) and a fit is physical (a row costs
        time). The cost a key is dropped (0) when the keys never vary apart from the rows or it fits below zero."""
        rows = [r for r, _, _ in self.samples]
        if len(rows) < 3 or max(rows) < 2 * min(rows):
            return None
        x = np.array([(1.0, r, k) for r, k, _ in self.samples])
        y = np.array([s for _, _, s in self.samples])
        for cols in ([0, 1, 2], [0, 1]):
            scale = np.abs(x[:, cols]).max(axis=0)  # keys run to millions: scale before solving
            if len(self.samples) <= len(cols) or scale.min() <= 0:
                continue
            coef, _, rank, _ = np.linalg.lstsq(x[:, cols] / scale, y, rcond=None)
            coef = coef / scale
            if rank == len(cols) and coef[1] > 0 and (len(cols) == 2 or coef[2] >= 0):
                # a fixed cost small next to the steps' noise can fit a little below zero: it is then ~0
                return max(0.0, float(coef[0])), float(coef[1]), float(coef[2]) if len(cols) == 3 else 0.0
        return None

    def rows(self, decoders: int = 0, decode_keys: int = 0, depth: int = 0) -> int:
        """Prefill rows a step may carry beside `decoders` decode rows attending to `decode_keys` keys in all,
        for a prefill chunk that starts `depth` positions into its sequence."""
        fit = self.fit() if self.adaptive else None
        if fit is None:
            return self.floor
        fixed, per_row, per_key = fit
        rest = fixed + per_row * decoders + per_key * decode_keys  # what the step costs without its prefill
        target = OVERHEAD_RATIO * rest
        # R rows at `depth` cost R * (per_row + per_key * depth) + per_key * R^2 / 2: solve for `target`
        linear = per_row + per_key * (depth + 0.5)
        want = target / linear if per_key == 0 else (np.sqrt(linear ** 2 + 2 * per_key * target) - linear) / per_key
        want = math.ceil(want / ROUND) * ROUND
        return max(self.floor, min(self.ceiling, want))
