"""world.py under a real `mlx.launch`: rank 0's ints reach every rank, strings gather in rank order,
and `mlx.launch -n 1` (an empty ring hostfile) is one plain rank, not an error."""

import json
import subprocess
import sys

import pytest
from distributed_launch import env, launch, launch_command, why_not

SCRIPT = """
import json
from justfit.distributed import agree, broadcast_ints, gather_strings, launched, world
w = world()
got = {"launched": launched(), "rank": w.rank, "size": w.size,
       "ints": broadcast_ints([7, -3, 2**40] if w.is_front else [9]),
       "empty": broadcast_ints([] if w.is_front else [1, 2]),
       "stop": agree(w.is_front),
       "names": gather_strings("r%d:%s" % (w.rank, "é" * w.rank))}
print(json.dumps(got), flush=True)
"""


def _runs(tmp_path, n):
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    if n == 1:
        r = subprocess.run(launch_command(1, [sys.executable, script]), capture_output=True, text=True, timeout=120,
                           env=env())
    else:
        r = launch(n, [script], timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    return sorted((json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")), key=lambda d: d["rank"])


def test_rank_0_decides_for_everyone(tmp_path):
    reason = why_not()
    if reason:
        pytest.skip(reason)
    ranks = _runs(tmp_path, 2)
    assert [d["rank"] for d in ranks] == [0, 1] and all(d["launched"] and d["size"] == 2 for d in ranks)
    for d in ranks:
        assert d["ints"] == [7, -3, 2**40] and d["empty"] == [] and d["stop"] is True
        assert d["names"] == ["r0:", "r1:é"]


def test_mlx_launch_one_rank_is_a_plain_process(tmp_path):
    reason = why_not()
    if reason:
        pytest.skip(reason)
    (d,) = _runs(tmp_path, 1)
    assert (d["launched"], d["size"], d["ints"], d["names"]) == (False, 1, [7, -3, 2**40], ["r0:"])
