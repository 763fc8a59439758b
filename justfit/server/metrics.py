"""Prometheus text metrics: requests, tokens, cached tokens, TTFT and inter-token histograms, queue
length and batch size (the worker's snapshot of the engine), KV pool pages and resident bytes per
component (read from the runtime at scrape time)."""

import threading
from bisect import bisect_left
from collections import defaultdict
from typing import Dict, Tuple

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Histogram:
    """Cumulative buckets, sum and count, as Prometheus expects."""

    def __init__(self, buckets):
        self.buckets, self.counts, self.sum, self.n = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, v: float):
        i = bisect_left(self.buckets, v)
        if i < len(self.counts):
            self.counts[i] += 1
        self.sum, self.n = self.sum + v, self.n + 1

    def lines(self, name: str):
        acc = 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            yield f'{name}_bucket{{le="{b}"}} {acc}'
        yield f'{name}_bucket{{le="+Inf"}} {self.n}'
        yield f"{name}_sum {self.sum:.6f}"
        yield f"{name}_count {self.n}"


class Metrics:
    """Counters and histograms the routes update; render() adds gauges read from the runtime."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: Dict[Tuple[str, int], int] = defaultdict(int)
        self.tokens: Dict[str, int] = defaultdict(int)
        self.ttft, self.itl = Histogram(TTFT_BUCKETS), Histogram(ITL_BUCKETS)
        self.cancelled = 0

    def request(self, route: str, status: int):
        with self.lock:
            self.requests[(route, status)] += 1

    def turn(self, prompt: int, completion: int, cached: int, ttft_s=None):
        with self.lock:
            self.tokens["prompt"] += prompt
            self.tokens["completion"] += completion
            self.tokens["cached"] += cached
            if ttft_s is not None:
                self.ttft.observe(ttft_s)

    def gap(self, seconds: float):
        with self.lock:
            self.itl.observe(seconds)

    def render(self, rt, batch: dict) -> str:
        """The whole exposition text; `batch`: waiting, running, max_running, steps, preempted."""
        out = ["# HELP justfit_requests_total HTTP requests by route and status.",
               "# TYPE justfit_requests_total counter"]
        with self.lock:
            out += [f'justfit_requests_total{{route="{r}",status="{s}"}} {n}' for (r, s), n in sorted(self.requests.items())]
            for kind in ("prompt", "completion", "cached"):
                out += [f"# TYPE justfit_{kind}_tokens_total counter", f"justfit_{kind}_tokens_total {self.tokens[kind]}"]
            out += ["# TYPE justfit_cancelled_requests_total counter", f"justfit_cancelled_requests_total {self.cancelled}"]
            out += ["# HELP justfit_ttft_seconds Time to first token.", "# TYPE justfit_ttft_seconds histogram"]
            out += list(self.ttft.lines("justfit_ttft_seconds"))
            out += ["# HELP justfit_inter_token_seconds Gap between streamed tokens.",
                    "# TYPE justfit_inter_token_seconds histogram"]
            out += list(self.itl.lines("justfit_inter_token_seconds"))
        out += ["# HELP justfit_queue_length Requests waiting to start generating.",
                "# TYPE justfit_queue_length gauge", f"justfit_queue_length {batch['waiting']}",
                "# HELP justfit_batch_running Requests generating now (the engine's running batch).",
                "# TYPE justfit_batch_running gauge", f"justfit_batch_running {batch['running']}",
                "# HELP justfit_batch_running_max Largest running batch seen since start.",
                "# TYPE justfit_batch_running_max gauge", f"justfit_batch_running_max {batch['max_running']}",
                "# TYPE justfit_batch_steps_total counter", f"justfit_batch_steps_total {batch['steps']}",
                "# TYPE justfit_preempted_total counter", f"justfit_preempted_total {batch['preempted']}"]
        used, free = pool_pages(rt)
        out += ["# HELP justfit_pool_pages KV pages in the shared pool.", "# TYPE justfit_pool_pages gauge",
                f'justfit_pool_pages{{state="used"}} {used}', f'justfit_pool_pages{{state="free"}} {free}']
        out += ["# HELP justfit_resident_bytes Resident bytes per component (PhaseSwap).",
                "# TYPE justfit_resident_bytes gauge"]
        for c in rt.residency()["components"]:
            out.append(f'justfit_resident_bytes{{component="{c["name"]}",kind="{c["kind"]}"}} '
                       f'{c["bytes"] if c["resident"] else 0}')
        return "\n".join(out) + "\n"


def pool_pages(rt) -> Tuple[int, int]:
    """(pages referenced, ids free for reuse) in the runtime's shared KV page pool."""
    pool = rt.index.pool
    return len(pool.refs), pool.free_ids
