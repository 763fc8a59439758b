"""Each example in examples/ runs on the default model and prints exactly its golden output
(examples/expected/NAME.txt): greedy decoding, short replies. JUSTFIT_UPDATE_GOLDEN=1 rewrites them."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = ROOT / "examples" / "expected"
GOLDEN = sorted(p.stem for p in EXPECTED.glob("*.txt"))


def test_every_golden_has_its_example():
    assert GOLDEN and all((ROOT / "examples" / f"{name}.py").is_file() for name in GOLDEN)


@pytest.mark.parametrize("name", GOLDEN)
def test_example_prints_its_golden_output(name, default_model_dir, test_home, tmp_path):
    env = dict(os.environ, JUSTFIT_HOME=str(test_home),
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "agents"), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, str(ROOT / "examples" / f"{name}.py")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    golden = EXPECTED / f"{name}.txt"
    if os.environ.get("JUSTFIT_UPDATE_GOLDEN") == "1":
        golden.write_text(r.stdout)
    assert r.stdout == golden.read_text(), f"{name}: output differs from {golden} (stderr: {r.stderr[-500:]})"
