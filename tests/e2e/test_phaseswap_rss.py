"""Memory released is memory returned: in a clean process, a tool phase's RSS falls to a quarter of what it was
before (MLX's cache cleared and the C allocator's arenas trimmed), not just MLX's own count."""

import json
import os
import subprocess
import sys

import pytest

CHILD = """
import json, sys, psutil, justfit
rt = justfit.Runtime(model=sys.argv[1], home=sys.argv[2])
s = rt.session("rss")
s.generate("Write a haiku about the sea.", max_tokens=16)
p = psutil.Process()
before = p.memory_info().rss
with s.tool_phase() as released:
    during = p.memory_info().rss
print(json.dumps({"before": before, "during": during, "released": released}))
"""


def test_a_tool_phase_gives_the_released_bytes_back_to_the_os(default_model_dir, tmp_path):
    if not sys.platform.startswith("linux"):
        pytest.skip("RSS after malloc_trim is a glibc measure; other C libraries return large blocks themselves")
    env = dict(os.environ, JUSTFIT_WEIGHTS="fp32")  # full-size weights: the release dwarfs the interpreter's own RSS
    out = subprocess.run([sys.executable, "-c", CHILD, str(default_model_dir), str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["released"] > 0.5 * m["before"]  # the mechanism ran: the weights and the session's pages went
    assert m["during"] <= 0.25 * m["before"], m
    assert m["before"] - m["during"] >= 0.8 * m["released"], m
