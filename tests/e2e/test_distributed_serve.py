"""`mlx.launch -n 2 -- justfit serve`: rank 0 owns HTTP, every rank runs the one engine core with rank 0
leading. Real clients on loopback get from 2 ranks what a one-process server gives (greedy, 16-bit pages):
plain and streamed replies, three concurrent streams that run as one batch, a forced tool call, a
json_schema reply and frequency/presence penalties; a prompt_cache_key reuses the prefix, and with retention
it is a session every rank checkpoints; a rank killed with SIGKILL mid-reply makes the front
report it and exit 1 within a bounded time."""

import asyncio
import json
import re
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
STREAMS = ["one two three", "the cat sat on", "tell me about the river bank"]
UNIT = {"type": "function", "function": {"name": "set_unit", "description": "Set the temperature unit.",
                                         "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}},
                                                        "required": ["unit"], "additionalProperties": False}}}
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
          "required": ["answer", "sure"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    import shutil

    from statetrans_util import tiny_model_folder

    base = tmp_path_factory.mktemp("tiny-serve")
    folder = shutil.copytree(tiny_model_folder(base, layers=4), base / "long")  # a tool prompt passes 256 tokens
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    return folder


class Ranks:
    """`justfit serve` as 2 ring ranks under mlx.launch; rank 0 answers on `url`."""

    def __init__(self, folder, home: Path, *args, timeout: float = 180):
        home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = launch_command(2, [sys.executable, "-m", "justfit", "serve", "--model", folder, "--port", self.port,
                                 "--kv-bits", "16", *args])
        self.home, self.err_path = home, home / "launch.err"
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


def _ask(url: str, prompt: str, stream: bool = False, max_tokens: int = 12, **extra) -> str:
    client = _client(url)
    messages = [{"role": "user", "content": prompt}]
    if stream:
        parts = client.chat.completions.create(model="default", messages=messages, max_tokens=max_tokens,
                                               temperature=0, stream=True, **extra)
        return "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    r = client.chat.completions.create(model="default", messages=messages, max_tokens=max_tokens, temperature=0,
                                       **extra)
    return r.choices[0].message.content


def _client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def _structured(url: str) -> dict:
    """A forced tool call (named, and tool_choice required), a json_schema reply and a penalized reply."""
    c, user = _client(url), [{"role": "user", "content": "which unit?"}]
    out = {}
    for name, choice in (("named", {"type": "function", "function": {"name": "set_unit"}}), ("required", "required")):
        r = c.chat.completions.create(model="default", messages=user, max_tokens=160, temperature=0, tools=[UNIT],
                                      tool_choice=choice).choices[0]
        call = r.message.tool_calls[0].function if r.message.tool_calls else None
        out[name] = (r.finish_reason, call and call.name, call and call.arguments)
    r = c.chat.completions.create(model="default", messages=user, max_tokens=40, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA, "strict": True}})
    out["json"] = r.choices[0].message.content
    out["penalized"] = _ask(url, PROMPTS[1], frequency_penalty=1.5, presence_penalty=1.0)
    return out


async def _streams(url: str) -> list:
    from openai import AsyncOpenAI

    c = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)

    async def one(prompt):
        parts = await c.chat.completions.create(model="default", messages=[{"role": "user", "content": prompt}],
                                                max_tokens=16, temperature=0, stream=True)
        return "".join([p.choices[0].delta.content or "" async for p in parts if p.choices])

    return await asyncio.gather(*(one(p) for p in STREAMS))


def _metric(url: str, name: str) -> int:
    return int(re.search(re.escape(name) + r" (\d+)", httpx.get(url + "/metrics", timeout=10).text).group(1))


@pytest.fixture(scope="module")
def one_process(tiny_folder, tmp_path_factory):
    """What a one-process server answers: plain replies, the structured requests, the streams one at a time."""
    _skip_without_launch()
    home = tmp_path_factory.mktemp("serve-one")
    one = Served(home, str(tiny_folder), "--kv-bits", "16")
    try:
        return {"plain": [_ask(one.url, p) for p in PROMPTS], **_structured(one.url),
                "streams": [_ask(one.url, p, stream=True, max_tokens=16) for p in STREAMS]}
    finally:
        one.stop()


@pytest.fixture(scope="module")
def two(tiny_folder, tmp_path_factory):
    _skip_without_launch()
    ranks = Ranks(tiny_folder, tmp_path_factory.mktemp("serve-two"))
    yield ranks
    ranks.close()


@pytest.mark.slow  # ~85 s on 2 cores: a 1-process server, then a 2-rank one
def test_serve_two_ranks_same_text_as_one_process(one_process, two):
    want = one_process["plain"]
    assert all(want) and len(set(want)) == 2, want
    got = [_ask(two.url, p) for p in PROMPTS]
    streamed = _ask(two.url, PROMPTS[0], stream=True)  # streamed, and the prefix cache now holds it
    assert got == want and streamed == want[0]


@pytest.mark.slow
def test_serve_two_ranks_tools_json_schema_and_penalties(one_process, two):
    got = _structured(two.url)
    for name in ("named", "required"):
        reason, fn, args = got[name]
        assert reason == "tool_calls" and fn == "set_unit" and json.loads(args)["unit"] in ("c", "f"), got
    import jsonschema

    jsonschema.validate(json.loads(got["json"]), SCHEMA)
    assert got["penalized"] and got["penalized"] != one_process["plain"][1]  # the penalties took effect
    assert got == {k: one_process[k] for k in got}  # token for token what one process gives


@pytest.mark.slow
def test_serve_two_ranks_batches_concurrent_streams(one_process, two):
    steps = _metric(two.url, "justfit_batch_steps_total")
    got = asyncio.run(_streams(two.url))
    assert got == one_process["streams"] and all(got)
    assert _metric(two.url, "justfit_batch_running_max") >= 2  # one batch, not one request after another
    assert _metric(two.url, "justfit_batch_steps_total") - steps < 3 * 16  # shared steps


@pytest.mark.slow
def test_serve_two_ranks_prompt_cache_key(two):
    c, key = _client(two.url), "two-ranks"
    turns = [[{"role": "user", "content": "tell me about the river bank and the boats"}]]
    first = c.chat.completions.create(model="default", messages=turns[0], max_tokens=8, temperature=0,
                                      prompt_cache_key=key)
    turns.append(turns[0] + [{"role": "assistant", "content": first.choices[0].message.content},
                             {"role": "user", "content": "and then?"}])
    second = c.chat.completions.create(model="default", messages=turns[1], max_tokens=8, temperature=0,
                                       prompt_cache_key=key)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    kept, replies = "two-ranks-kept", []
    for messages in turns:  # a persisted session: every rank holds it over its own shard of the pages
        r = c.chat.completions.create(model="default", messages=messages, max_tokens=8, temperature=0,
                                      prompt_cache_key=kept, extra_body={"prompt_cache_retention": "24h"})
        replies.append(r)
    assert replies[0].choices[0].message.content == first.choices[0].message.content  # same tokens as a plain request
    assert replies[1].usage.prompt_tokens_details.cached_tokens >= replies[0].usage.prompt_tokens
    assert _ask(two.url, PROMPTS[0])  # the ranks are still in step (and rank 1 has replayed every turn before)
    from justfit.statetrans.manifest import read_manifest

    world = json.loads((two.home / "sessions" / "world" / f"{kept}.json").read_text())
    ranks = [read_manifest(two.home, r["session"]) for r in world["ranks"]]  # each rank's own checkpoint
    assert len(ranks) == 2 and all(m is not None and len(m.tokens) > replies[0].usage.prompt_tokens for m in ranks)
    assert ranks[0].tokens == ranks[1].tokens  # the same history on both ranks, each over its own shard
    assert ranks[0].model_fingerprint != ranks[1].model_fingerprint


@pytest.mark.slow
def test_serve_two_ranks_stay_in_step_after_a_disconnect_and_sampling(one_process, two):
    """A client that leaves mid-stream cancels its request on every rank at the same step, and unseeded
    sampling draws rank 0's seed everywhere: the greedy reply after both is still one process's."""
    cancelled = _metric(two.url, "justfit_cancelled_requests_total")
    body = {"model": "default", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 200, "stream": True}
    with httpx.stream("POST", two.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert sum(1 for line, _ in zip(r.iter_lines(), range(4)) if line.startswith("data:")) >= 1
    sampled = _client(two.url).chat.completions.create(model="default", max_tokens=12, temperature=0.9,
                                                       messages=[{"role": "user", "content": PROMPTS[0]}])
    assert sampled.choices[0].message.content
    assert _ask(two.url, PROMPTS[1]) == one_process["plain"][1]
    assert _metric(two.url, "justfit_cancelled_requests_total") == cancelled + 1


@pytest.mark.slow
def test_serve_two_ranks_stop_on_sigterm(two):
    two.proc.send_signal(signal.SIGTERM)
    two.proc.wait(timeout=60)
    assert "exited with code" not in two.err() and "lost a rank" not in two.err(), two.err()[-3000:]
    assert "Traceback" not in two.err(), two.err()[-3000:]


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
