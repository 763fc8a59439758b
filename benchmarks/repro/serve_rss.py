"""`justfit serve`'s resident memory around a burst of concurrent requests: RSS before (after one warm-up
request), the peak during 200 concurrent chat completions, and RSS once the server has been idle for 60 s.
The server is a real process (tests/server_support.Served) with the default model; --max-queue is raised
to the burst size so every request runs (none is refused with 503).

Usage: python benchmarks/repro/serve_rss.py [REQUESTS] [IDLE_SECONDS] [MAX_TOKENS] [extra serve flags...]
Prints one line per phase in MiB, then the status codes of the burst.
"""

import collections
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def rss_mib(pid: int) -> float:
    """Resident set of a process (VmRSS), in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _ask(url: str, i: int, max_tokens: int, codes: collections.Counter, lock: threading.Lock):
    body = {"model": "default", "max_tokens": max_tokens, "temperature": 0.7, "seed": i,
            "messages": [{"role": "user", "content": f"Request {i}: write a line about the number {i * 7919}."}]}
    try:
        code = httpx.post(url + "/v1/chat/completions", json=body, timeout=600).status_code
    except httpx.HTTPError as e:
        code = type(e).__name__
    with lock:
        codes[code] += 1


def measure(server, requests: int = 200, idle: float = 60.0, max_tokens: int = 16) -> dict:
    """RSS before, peak during and `idle` seconds after `requests` concurrent requests to a running Served."""
    pid = server.proc.pid
    codes, lock = collections.Counter(), threading.Lock()
    _ask(server.url, -1, max_tokens, collections.Counter(), lock)  # warm-up: the engine and its first pages exist
    time.sleep(2)
    before = rss_mib(pid)
    threads = [threading.Thread(target=_ask, args=(server.url, i, max_tokens, codes, lock)) for i in range(requests)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    peak = before
    while any(t.is_alive() for t in threads):
        peak = max(peak, rss_mib(pid))
        time.sleep(0.1)
    burst = time.perf_counter() - t0
    time.sleep(idle)
    return {"before": before, "peak": peak, "after": rss_mib(pid), "burst_s": burst, "codes": dict(codes)}


def main():
    from justfit.models import default_model
    from tests.server_support import Served

    args = sys.argv[1:]
    requests, idle, max_tokens = ([int(a) for a in args[:3]] + [200, 60, 16][len(args[:3]):])[:3]
    extra = args[3:]
    home = Path.home() / ".cache" / "justfit-tests"
    model = str(default_model(home))
    with tempfile.TemporaryDirectory() as tmp:
        server = Served(Path(tmp), model, "--max-queue", str(requests), *extra)
        try:
            r = measure(server, requests, idle, max_tokens)
        finally:
            server.stop()
    print(f"RSS before: {r['before']:.0f} MiB")
    print(f"RSS peak during {requests} concurrent requests ({r['burst_s']:.1f} s): {r['peak']:.0f} MiB")
    print(f"RSS {idle} s after: {r['after']:.0f} MiB ({r['after'] / r['before']:.2f}x before)")
    print(f"status codes: {r['codes']}")


if __name__ == "__main__":
    main()
