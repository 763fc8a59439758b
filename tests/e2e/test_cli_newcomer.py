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
