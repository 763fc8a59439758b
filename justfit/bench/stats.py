"""How every bench summarizes: a median over rounds with its min and max, and latency percentiles."""

import statistics
from typing import Iterable, Optional


def spread(name: str, values: Iterable) -> dict:
    """{name: median, name_min, name_max} of per-round values; rounds with no value (None) are left out, and
    all three are None when no round has one."""
    xs = [x for x in values if x is not None]
    if not xs:
        return {name: None, f"{name}_min": None, f"{name}_max": None}
    return {name: statistics.median(xs), f"{name}_min": min(xs), f"{name}_max": max(xs)}


def percentile(xs: Iterable[float], q: float, default: Optional[float] = None) -> Optional[float]:
    """The q-quantile (0 <= q <= 1) of xs as the nearest rank among the sorted samples (index q * (n - 1),
    rounded), so p99 of 100 samples is the 99th; `default` when there are none."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else default
