"""What a newcomer meets on the command line: mistakes and no-op options are one line each (exit code 2
for an error), before any model loads."""

import os
import socket
import subprocess
import sys


def _justfit(*args, home, stdin: str = "", timeout: float = 300):
    env = dict(os.environ, JUSTFIT_HOME=str(home))
    return subprocess.run([sys.executable, "-m", "justfit", *args], input=stdin, capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_serve_on_a_busy_port_is_one_line_exit_2(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = _justfit("serve", "--port", str(port), home=tmp_path, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert f"port {port} on 127.0.0.1 is in use" in r.stderr


def test_chat_prefill_calls_progress_several_times(runtime16):
    calls = []
    prompt = " ".join(f"word{i}" for i in range(400))  # ~1k tokens
    g = runtime16.generate(prompt, max_tokens=1, progress=lambda done, total: calls.append((done, total)))
    assert g.stats.prefilled_tokens > 900
    assert len(calls) >= 3 and all(d < t for d, t in calls), calls


def test_seed_with_greedy_decoding_says_it_does_nothing(test_home, default_model_dir):
    r = _justfit("chat", "-p", "Hi", "--max-tokens", "2", "--seed", "7", home=test_home)
    assert r.returncode == 0, r.stderr
    notes = [line for line in r.stderr.splitlines() if "--seed" in line]
    assert len(notes) == 1 and "does nothing with --temp 0" in notes[0], r.stderr
    r = _justfit("chat", "-p", "Hi", "--max-tokens", "2", "--seed", "7", "--temp", "0.7", home=test_home)
    assert r.returncode == 0 and "--seed" not in r.stderr, r.stderr


def test_models_rm_default_removes_what_pull_default_fetched(tmp_path, default_model_dir):
    import shutil

    shutil.copytree(default_model_dir, tmp_path / "models" / default_model_dir.name)
    r = _justfit("models", "rm", "default", home=tmp_path, timeout=60)
    assert r.returncode == 0 and "removed" in r.stdout, r.stderr
    assert not (tmp_path / "models" / default_model_dir.name).exists()
    r = _justfit("models", "rm", "default", home=tmp_path, timeout=60)
    assert r.returncode == 2 and "no cached model named 'default'" in r.stderr


def test_help_shows_no_value_for_on_off_flags(tmp_path):
    r = _justfit("chat", "--help", home=tmp_path, timeout=60)
    assert r.returncode == 0
    assert "--json" in r.stdout and "<bool>" not in r.stdout
    assert "<str>" in r.stdout  # options that take a value still show its type


def test_the_readme_probe_output_folder_is_ignored_by_git():
    """`justfit probe ... --out runs/cpu` (README) writes into the checkout: git must not offer it."""
    import shutil
    from pathlib import Path

    import pytest

    root = Path(__file__).resolve().parents[2]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout (or no git)")
    assert "--out runs/cpu" in (root / "README.md").read_text()
    r = subprocess.run(["git", "check-ignore", "-q", "runs/cpu/probe.json"], cwd=root)
    assert r.returncode == 0, "runs/ is not in .gitignore"
