"""`justfit serve` under load and across restarts: 32 concurrent streaming clients all complete (batched
together by the engine) and leave no pages behind; a persisted prompt_cache_key session is reused by the
first request after a restart (cached_tokens > 0)."""

import asyncio
import re
from pathlib import Path

import httpx
import pytest

from tests.server_support import Served

openai = pytest.importorskip("openai")
SYSTEM = "You are a careful travel agent. " + " ".join(
    f"Policy {i}: quote prices in euros and name the city first." for i in range(50))


def _pages(url: str) -> int:
    return int(re.search(r'justfit_pool_pages\{state="used"\} (\d+)', httpx.get(url + "/metrics").text).group(1))


@pytest.mark.slow
def test_32_concurrent_streaming_clients(default_model_dir, tmp_path):
    s = Served(tmp_path, str(default_model_dir))
    try:
        before = _pages(s.url)
        client = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=600)

        async def one(i):
            text, finish = "", None
            stream = await client.chat.completions.create(
                model="default", max_tokens=3, temperature=0, stream=True,
                messages=[{"role": "user", "content": f"Client {i}: say a number."}])
            async for c in stream:
                if c.choices:
                    text += c.choices[0].delta.content or ""
                    finish = c.choices[0].finish_reason or finish
            return text, finish

        async def all_clients():
            return await asyncio.gather(*(one(i) for i in range(32)))

        results = asyncio.run(all_clients())
        assert len(results) == 32 and all(finish in ("stop", "length") for _, finish in results)
        assert sum(bool(t) for t, _ in results) >= 30
        assert _pages(s.url) <= before + 32  # requests released their pages; the index may keep one open page per prompt
        assert httpx.get(s.url + "/health").json()["queue_length"] == 0
        assert int(re.search(r"justfit_batch_running_max (\d+)", httpx.get(s.url + "/metrics").text).group(1)) > 1
    finally:
        s.stop()


def test_persisted_session_is_cached_after_restart(default_model_dir, tmp_path):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "A weekend in Rome?"}]
    extra = {"prompt_cache_key": "trip", "prompt_cache_retention": "24h"}
    s = Served(tmp_path, str(default_model_dir))
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=300)
        r1 = client.chat.completions.create(model="default", messages=messages, max_tokens=4, temperature=0,
                                            extra_body=extra)
    finally:
        s.stop()
    assert (Path(tmp_path) / "sessions").exists() and any((Path(tmp_path) / "sessions").iterdir())
    messages += [{"role": "assistant", "content": r1.choices[0].message.content},
                 {"role": "user", "content": "And Milan?"}]
    s = Served(tmp_path, str(default_model_dir))
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=300)
        r2 = client.chat.completions.create(model="default", messages=messages, max_tokens=4, temperature=0,
                                            extra_body=extra)
    finally:
        s.stop()
    cached = r2.usage.prompt_tokens_details.cached_tokens
    # the whole first turn came back from disk (its open page too), only the new message was prefilled
    assert r1.usage.prompt_tokens <= cached < r2.usage.prompt_tokens, (cached, r1.usage, r2.usage)


def test_persist_saves_the_prefix_cache_so_an_anthropic_prompt_is_cached_after_restart(default_model_dir, tmp_path):
    """Under --persist the server writes its prefix cache's sealed pages at shutdown: after a restart a
    Messages request (no session, no key: what Claude Code sends) finds its prompt's prefix on disk."""
    body = {"model": "default", "max_tokens": 2, "temperature": 0, "system": SYSTEM,
            "messages": [{"role": "user", "content": "A weekend in Rome?"}]}

    def ask(url):
        r = httpx.post(url + "/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"}, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    s = Served(tmp_path, str(default_model_dir), "--persist")
    try:
        first = ask(s.url)
    finally:
        s.stop()
    assert "prefix cache saved" in s.text()
    s = Served(tmp_path, str(default_model_dir), "--persist")
    try:
        again = ask(s.url)
    finally:
        s.stop()
    prompt = first["input_tokens"] + first["cache_read_input_tokens"] + first["cache_creation_input_tokens"]
    assert first["cache_read_input_tokens"] == 0 and prompt > 512
    assert again["cache_read_input_tokens"] >= prompt // 256 * 256 - 256, (first, again)  # every sealed page
