"""`justfit serve`'s memory comes back after a burst: RSS 60 s after 200 concurrent requests stays within
1.25x of RSS before plus 64 MiB (the engine's page pool and prefix cache keep some of what the burst
filled, by design). Slow: a real server process, minutes on a small machine."""

import importlib.util
from pathlib import Path

import pytest

from tests.server_support import Served

ROOT = Path(__file__).resolve().parents[2]
SLACK_MIB = 64


def _serve_rss():
    spec = importlib.util.spec_from_file_location("serve_rss", ROOT / "benchmarks" / "repro" / "serve_rss.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_rss_comes_back_after_200_concurrent_requests(default_model_dir, tmp_path):
    server = Served(tmp_path, str(default_model_dir), "--max-queue", "200")
    try:
        r = _serve_rss().measure(server, requests=200, idle=60.0, max_tokens=16)
    finally:
        server.stop()
    print(f"\nRSS MiB: before {r['before']:.0f}, peak {r['peak']:.0f}, 60 s after {r['after']:.0f}; "
          f"burst {r['burst_s']:.0f} s; codes {r['codes']}")
    assert r["codes"] == {200: 200}, r
    assert r["after"] <= 1.25 * r["before"] + SLACK_MIB, r
