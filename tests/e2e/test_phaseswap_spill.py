"""Weight spill files belong to the process that wrote them: nothing stays behind after a start refused
by --memory-budget, and a killed process's files are swept by the next one."""

import os
import subprocess
import sys

from justfit.phaseswap import components


def test_refused_start_leaves_no_spill_files(default_model_dir, tmp_path):
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / default_model_dir.name).symlink_to(default_model_dir)
    env = dict(os.environ, JUSTFIT_HOME=str(home))
    r = subprocess.run([sys.executable, "-m", "justfit", "chat", "-p", "hi", "--memory-budget", "100MB"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "needs" in r.stderr and "budget 100.0 MB" in r.stderr, r.stderr
    left = [p for p in (home / "spill").rglob("*") if p.is_file()] if (home / "spill").exists() else []
    assert left == []


def test_dead_processes_files_are_swept_and_own_files_removed_at_exit(tmp_path):
    folder = tmp_path / "weights" / "abc"
    folder.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # that process has exited
    me = os.getpid()
    stale = [folder / f"layers.0-5.{pid}.safetensors", folder / f".embed.{pid}.safetensors.{pid}.ab12.tmp.safetensors",
             folder / "embed.safetensors"]  # a dead writer's file and temp file, and the old shared name
    mine = [folder / f"embed.{me}.safetensors", folder / f".norm.{me}.safetensors.{me}.cd34.tmp.safetensors"]
    for f in [*stale, *mine]:
        f.write_bytes(b"x")
    components._claim(folder)
    assert not any(f.exists() for f in stale) and all(f.exists() for f in mine)
    mine[1].unlink()  # (a finished write renames its temp file away)
    mine = mine[0]
    components.discard_spills()
    assert not mine.exists() and not folder.exists()
