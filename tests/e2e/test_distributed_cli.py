"""`mlx.launch -n 2 -- justfit chat --prompt ...`: rank 0 prints the reply once, the follower prints
nothing; a rank killed mid-reply stops the whole run (no hang) and the launch says which rank died."""

import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
from distributed_launch import env, free_port, launch, launcher, rank_process, why_not


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from statetrans_util import tiny_model_folder

    return tiny_model_folder(tmp_path_factory.mktemp("tiny-cli"), layers=4, context=1 << 17)  # a 100k-token reply fits


def _skip_without_launch():
    reason = why_not()
    if reason:
        pytest.skip(reason)


def _chat(folder, n_tokens):
    return ["-m", "justfit", "chat", "--model", str(folder), "--prompt", "hello there", "--max-tokens", str(n_tokens),
            "--kv-bits", "16"]


@pytest.mark.slow
def test_chat_two_ranks_prints_once_like_one_process(tiny_folder, tmp_path):
    _skip_without_launch()
    one = launch(1, _chat(tiny_folder, 8), timeout=120, JUSTFIT_HOME=tmp_path / "h1")
    two = launch(2, _chat(tiny_folder, 8), timeout=240, JUSTFIT_HOME=tmp_path / "h2")
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    assert one.stdout.strip() and two.stdout == one.stdout  # printed once, same reply


def test_dead_rank_stops_the_run_without_hanging(tiny_folder, tmp_path):
    _skip_without_launch()
    cmd = [launcher(), "-n", "2", "--backend", "ring", "-p", str(free_port()), "--python", sys.executable, "--",
           *_chat(tiny_folder, 100000)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env(JUSTFIT_HOME=tmp_path / "h", PYTHONUNBUFFERED=1))
    printed = []
    threading.Thread(target=lambda: printed.append(proc.stdout.read(1)), daemon=True).start()
    try:
        follower = rank_process(psutil.Process(proc.pid), "1", time.time() + 60)
        assert follower is not None, "rank 1 never started"
        deadline = time.time() + 300
        while not printed and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)  # wait for the first streamed text: the reply is under way (100000 tokens: hours)
        assert printed and proc.poll() is None, f"no reply started: {proc.poll()}"
        follower.send_signal(signal.SIGKILL)
        start = time.time()
        _, err = proc.communicate(timeout=90)  # a hang fails here
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert time.time() - start < 90
    assert "rank 1" in err, err[-2000:]


@pytest.mark.slow
def test_followers_run_what_rank_0_leads(tiny_folder, tmp_path):
    """The server's way: only rank 0 sees requests (a turn, then a batch run serially); it broadcasts each,
    the follower runs the same turn."""
    _skip_without_launch()
    from distributed_launch import WORKER, last_json

    args = [WORKER, "follow", tiny_folder, tmp_path / "home", 16, 6, "tell me a story"]
    one = last_json(launch(1, args, timeout=120))
    two = last_json(launch(2, args, timeout=240))
    assert len(one["tokens"]) == 3 and two["tokens"] == one["tokens"]
    assert one["tokens"][2] == one["tokens"][0]  # the batch's second request is the first turn again
    assert [r["sharding"]["kind"] for r in two["ranks"]] == ["tensor", "tensor"]


def _session_chat(folder, name, prompt):
    return ["-m", "justfit", "chat", "--model", str(folder), "--session", name, "--prompt", prompt,
            "--max-tokens", "6", "--kv-bits", "16"]


@pytest.mark.slow  # ~2 min on 2 cores: three 2-rank launches and two single processes
def test_chat_session_world_manifest(tiny_folder, tmp_path):
    """`chat --session` under mlx.launch: resumes on 2 ranks, refused on 1 (exit 2, one line); a 1-rank
    session is refused on 2 ranks (every rank refuses, none is left waiting)."""
    _skip_without_launch()
    home = tmp_path / "h"
    first = launch(2, _session_chat(tiny_folder, "w1", "hello there"), timeout=240, JUSTFIT_HOME=home)
    assert first.returncode == 0 and first.stdout.strip(), first.stderr[-2000:]
    assert (home / "sessions" / "world" / "w1.json").exists()
    again = launch(2, _session_chat(tiny_folder, "w1", "and once more"), timeout=240, JUSTFIT_HOME=home)
    assert again.returncode == 0 and "[session 'w1': 2 earlier messages" in again.stderr, again.stderr[-2000:]
    assert "exited with code" not in again.stderr

    one = launch(1, _session_chat(tiny_folder, "w1", "alone"), timeout=120, JUSTFIT_HOME=home)
    assert one.returncode == 2
    assert one.stderr.strip().splitlines() == [
        "justfit: error: session 'w1' was checkpointed by 2 ranks (tensor parallel); this run has 1; resume it "
        "with `mlx.launch -n 2` (re-sharding pages is not supported)"], one.stderr

    plain = launch(1, _session_chat(tiny_folder, "p1", "hello"), timeout=120, JUSTFIT_HOME=home)
    assert plain.returncode == 0, plain.stderr
    refused = launch(2, _session_chat(tiny_folder, "p1", "hello"), timeout=240, JUSTFIT_HOME=home)
    assert "session 'p1' was checkpointed by 1 rank; this run has 2 ranks" in refused.stderr, refused.stderr[-2000:]
    # rank 1 refuses at the same point; mlx.launch may SIGTERM it first, once rank 0 has exited
    assert "rank 0 exited with code 2" in refused.stderr
    assert any(f"rank 1 exited with code {c}" in refused.stderr for c in (2, -15)), refused.stderr[-2000:]
