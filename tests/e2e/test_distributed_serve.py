"""`mlx.launch -n 2 -- justfit serve`: rank 0 owns HTTP, the follower mirrors each turn. A real openai
client on loopback gets the same greedy text as from a one-process server (16-bit pages); a rank
killed with SIGKILL mid-reply makes the front report it and exit 1 within a bounded time."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from distributed_launch import env, launch_command, rank_process, why_not
from server_support import Served, free_port

PROMPTS = ["hello there", "tell me about the river bank"]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from statetrans_util import tiny_model_folder

    return tiny_model_folder(tmp_path_factory.mktemp("tiny-serve"), layers=4)


class Ranks:
    """`justfit serve` as 2 ring ranks under mlx.launch; rank 0 answers on `url`."""

    def __init__(self, folder, home: Path, *args, timeout: float = 180):
        home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = launch_command(2, [sys.executable, "-m", "justfit", "serve", "--model", folder, "--port", self.port,
                                 "--kv-bits", "16", *args])
        self.err_path = home / "launch.err"
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(self.err_path, "wb"),
                                     env=env(JUSTFIT_HOME=home, PYTHONUNBUFFERED=1))
        deadline = time.time() + timeout
        while time.time() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        self.close()
        raise AssertionError(f"2-rank server did not start: {self.err()[-3000:]}")

    def err(self) -> str:
        return self.err_path.read_text(errors="replace")

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for p in psutil.process_iter(["environ"]):  # the ranks mlx.launch started, if they outlived it
            try:
                if (p.info["environ"] or {}).get("MLX_HOSTFILE") and str(self.port) in " ".join(p.cmdline()):
                    p.kill()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue


def _skip_without_launch():
    reason = why_not()
    if reason:
        pytest.skip(reason)


def _ask(url: str, prompt: str, stream: bool = False, **extra) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": prompt}]
    if stream:
        parts = client.chat.completions.create(model="default", messages=messages, max_tokens=12, temperature=0,
                                               stream=True, **extra)
        return "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    r = client.chat.completions.create(model="default", messages=messages, max_tokens=12, temperature=0, **extra)
    return r.choices[0].message.content


@pytest.mark.slow  # ~85 s on 2 cores: a 1-process server, then a 2-rank one
def test_serve_two_ranks_same_text_as_one_process(tiny_folder, tmp_path):
    _skip_without_launch()
    (tmp_path / "h1").mkdir()
    one = Served(tmp_path / "h1", str(tiny_folder), "--kv-bits", "16")
    try:
        want = [_ask(one.url, p) for p in PROMPTS]
    finally:
        one.stop()
    assert all(want) and len(set(want)) == 2, want
    two = Ranks(tiny_folder, tmp_path / "h2")
    try:
        got = [_ask(two.url, p) for p in PROMPTS]
        streamed = _ask(two.url, PROMPTS[0], stream=True)  # streamed, and the prefix cache now holds it
        refused = httpx.post(two.url + "/v1/chat/completions", timeout=60, json={
            "model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "response_format": {"type": "json_object"}})
        again = _ask(two.url, PROMPTS[1])  # the ranks are still in step after the refusal
        two.proc.send_signal(signal.SIGTERM)
        two.proc.wait(timeout=60)
    finally:
        two.close()
    assert got == want and streamed == want[0] and again == want[1]
    assert refused.status_code == 400 and "mlx.launch" in refused.json()["error"]["message"]
    assert "exited with code" not in two.err() and "lost a rank" not in two.err(), two.err()[-3000:]


@pytest.mark.slow  # ~70 s on 2 cores
def test_serve_dead_rank_stops_the_front(tiny_folder, tmp_path):
    _skip_without_launch()
    two = Ranks(tiny_folder, tmp_path / "h")
    try:
        assert _ask(two.url, PROMPTS[0])
        follower = rank_process(psutil.Process(two.proc.pid), "1", time.time() + 30)
        assert follower is not None, "rank 1 not found"
        with httpx.stream("POST", two.url + "/v1/chat/completions", timeout=120, json={
                "model": "default", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 220,
                "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data:")  # the reply is under way on both ranks (~1 s per 100 tokens)
            follower.send_signal(signal.SIGKILL)
            start = time.time()
            try:
                for _ in lines:  # ends (an error event or a closed connection), never hangs
                    pass
            except httpx.HTTPError:
                pass
        two.proc.wait(timeout=60)
        elapsed = time.time() - start
    finally:
        two.close()
    err = two.err()
    assert elapsed < 60
    assert "lost a rank of the mlx.launch world" in err, err[-3000:]
    assert "rank 0 exited with code 1" in err, err[-3000:]
