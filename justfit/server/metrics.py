"""Prometheus text metrics: requests, tokens, cached tokens, TTFT and inter-token histograms, queue
length and batch size (the worker's snapshot of the engine), KV pool pages and resident bytes per
component (read from the runtime at scrape time)."""

import threading
from bisect import bisect_left
from collections import defaultdict
from typing import Dict, List, Tuple

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

    def render(self, models) -> str:
        """The whole exposition text. `models`: (model id, runtime, batch) of each loaded model, where batch
        holds waiting, running, max_running, steps, preempted. The unlabelled gauges are totals over the
        models (running_max: the largest); the `justfit_model_*` series and the resident bytes carry a
        `model` label."""
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
        out += _batch_lines(models)
        out += _pool_lines(models)
        out += ["# HELP justfit_resident_bytes Resident bytes per model and component (PhaseSwap).",
                "# TYPE justfit_resident_bytes gauge"]
        for model, rt, _ in models:
            for c in rt.residency()["components"]:
                out.append(f'justfit_resident_bytes{{model="{_label(model)}",component="{c["name"]}",kind="{c["kind"]}"}} '
                           f'{c["bytes"] if c["resident"] else 0}')
        return "\n".join(out) + "\n"


BATCH = (("queue_length", "waiting", "gauge", "Requests waiting to start generating."),
         ("batch_running", "running", "gauge", "Requests generating now (the engine's running batch)."),
         ("batch_running_max", "max_running", "gauge", "Largest running batch seen since start."),
         ("batch_steps_total", "steps", "counter", "Engine steps."),
         ("preempted_total", "preempted", "counter", "Requests preempted to free KV pages."))


def _label(text: str) -> str:
    return str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")


def _batch_lines(models) -> List[str]:
    """Each batch gauge as a total over the models, then per model."""
    out = []
    for name, key, kind, help_text in BATCH:
        values = [b[key] for _, _, b in models]
        total = max(values, default=0) if key == "max_running" else sum(values)
        out += [f"# HELP justfit_{name} {help_text}", f"# TYPE justfit_{name} {kind}", f"justfit_{name} {total}"]
    for name, key, kind, help_text in BATCH:
        out += [f"# HELP justfit_model_{name} {help_text} Per model.", f"# TYPE justfit_model_{name} {kind}"]
        out += [f'justfit_model_{name}{{model="{_label(m)}"}} {b[key]}' for m, _, b in models]
    return out


def _pool_lines(models) -> List[str]:
    pages = [(m, *pool_pages(rt)) for m, rt, _ in models]
    out = ["# HELP justfit_pool_pages KV pages in the shared pools (all models).", "# TYPE justfit_pool_pages gauge",
           f'justfit_pool_pages{{state="used"}} {sum(p[1] for p in pages)}',
           f'justfit_pool_pages{{state="free"}} {sum(p[2] for p in pages)}',
           "# HELP justfit_model_pool_pages KV pages in each model's pool.", "# TYPE justfit_model_pool_pages gauge"]
    for m, used, free in pages:
        out += [f'justfit_model_pool_pages{{model="{_label(m)}",state="used"}} {used}',
                f'justfit_model_pool_pages{{model="{_label(m)}",state="free"}} {free}']
    return out


def pool_pages(rt) -> Tuple[int, int]:
    """(pages referenced, ids free for reuse) in the runtime's shared KV page pool."""
    pool = rt.index.pool
    return len(pool.refs), pool.free_ids
