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


def test_no_golden_output_reads_as_a_failure():
    """An example that exits 0 does not print a stop reason that reads as a failure."""
    for name in GOLDEN:
        text = (EXPECTED / f"{name}.txt").read_text()
        assert "repeat" not in text and "stopped:" not in text, name


def test_resume_example_says_what_it_restored(default_model_dir, test_home, tmp_path):
    """First run: a new session; second run: the earlier messages counted (no '1 messages'), the
    prompt mostly reused."""
    home = tmp_path / "home"
    home.mkdir()
    for sub in ("models", "kernels"):
        if (test_home / sub).exists():
            (home / sub).symlink_to(test_home / sub, target_is_directory=True)
    env = dict(os.environ, JUSTFIT_HOME=str(home),
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "agents"), os.environ.get("PYTHONPATH", "")]))
    runs = [subprocess.run([sys.executable, str(ROOT / "examples" / "agent_resume.py")], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=600) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-2000:]
    first, second = (r.stdout.splitlines() for r in runs)
    assert first[0].startswith("new session") and second[0].startswith("resumed session"), (first, second)
    assert "earlier messages" in second[0] and "stored: " in second[-1]
    reused = int(second[1].split("reused ")[1].split(",")[0])
    assert reused > 200, second
