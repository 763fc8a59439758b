"""`justfit serve` batches concurrent requests through the scheduler's engine: real openai SDK and httpx
clients on loopback. Concurrent streams overlap in the engine (its largest running batch > 1) and give
the same greedy text as the same requests one at a time; a client that leaves (streamed or not) cancels
its engine request and its pages go back; a tool_choice request and a persisted session turn still work
while others are batched."""

import asyncio
import json
import re
import time

import httpx
import pytest

from tests.server_support import Served

openai = pytest.importorskip("openai")

QUESTIONS = ["What is the capital of France?", "Name a primary color.", "Count from one to five.",
             "Say hello in Spanish."]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    s = Served(tmp_path_factory.mktemp("serve-batch-home"), str(default_model_dir))
    yield s
    assert s.stop() in (0, -15, 143), s.text()


def metric(url: str, name: str) -> int:
    return int(re.search(re.escape(name) + r" (\d+)", httpx.get(url + "/metrics").text).group(1))


def pages(url: str) -> int:
    return metric(url, 'justfit_pool_pages{state="used"}')


def settle(url: str, timeout: float = 60):
    """Wait until the server has nothing in flight (a cancelled request ends at the worker's next step)."""
    deadline = time.time() + timeout
    while time.time() < deadline and httpx.get(url + "/health").json()["queue_length"]:
        time.sleep(0.2)
    assert metric(url, "justfit_batch_running") == 0


async def stream_text(client, question: str, max_tokens: int = 10, **extra) -> str:
    text = ""
    stream = await client.chat.completions.create(model="default", max_tokens=max_tokens, temperature=0, stream=True,
                                                  messages=[{"role": "user", "content": question}], extra_body=extra)
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    return text


def test_concurrent_streams_overlap_and_equal_one_at_a_time(server):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)
    steps = metric(server.url, "justfit_batch_steps_total")

    async def run():
        together = await asyncio.gather(*(stream_text(client, q, max_tokens=8) for q in QUESTIONS[:3]))
        alone = [await stream_text(client, q, max_tokens=8) for q in QUESTIONS[:3]]
        return together, alone

    together, alone = asyncio.run(run())
    assert all(together) and together == alone
    assert metric(server.url, "justfit_batch_running_max") >= 2  # they ran in one batch, not one after another
    assert metric(server.url, "justfit_batch_steps_total") > steps
    settle(server.url)


def _leave_stream(url: str, question: str):
    """Stream a long reply and leave after a few chunks (the connection closes with the context)."""
    body = {"model": "default", "max_tokens": 2000, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": question}]}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 4:
                break


def test_disconnect_mid_stream_frees_pages_while_another_runs(server):
    before, cancelled = pages(server.url), metric(server.url, "justfit_cancelled_requests_total")
    generated = metric(server.url, "justfit_completion_tokens_total")
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)

    async def run():
        other = asyncio.create_task(stream_text(client, "Tell me about a river.", max_tokens=24))
        await asyncio.to_thread(_leave_stream, server.url, "Write a very long story about a lighthouse keeper.")
        return await other

    assert asyncio.run(run())
    settle(server.url)
    assert metric(server.url, "justfit_cancelled_requests_total") == cancelled + 1
    assert metric(server.url, "justfit_completion_tokens_total") - generated < 200  # stopped early, not at 2000
    # the finished request may leave its open page in the prefix index; the cancelled one leaves nothing
    assert pages(server.url) - before <= 1
    after = pages(server.url)
    _leave_stream(server.url, "Write a very long story about a lighthouse keeper.")
    settle(server.url)
    assert pages(server.url) == after  # pool back to where it was: the cancelled request's pages were freed


def test_non_streamed_disconnect_cancels(server):
    before, cancelled = pages(server.url), metric(server.url, "justfit_cancelled_requests_total")
    body = {"model": "default", "max_tokens": 2000, "temperature": 0,
            "messages": [{"role": "user", "content": "Write a very long essay about the sea, with many chapters."}]}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=3)
    settle(server.url)
    assert metric(server.url, "justfit_cancelled_requests_total") == cancelled + 1
    assert pages(server.url) == before


def test_tool_choice_and_persisted_session_while_others_are_batched(server):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)
    plain = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)
    question = "What is the capital of France?"
    reference = plain.chat.completions.create(model="default", max_tokens=10, temperature=0,
                                              messages=[{"role": "user", "content": question}])

    async def tool_call():
        r = await client.chat.completions.create(
            model="default", max_tokens=40, temperature=0, tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            messages=[{"role": "user", "content": "What's the weather in Paris?"}])
        return r.choices[0]

    async def run():
        return await asyncio.gather(
            tool_call(), *(stream_text(client, q, max_tokens=12) for q in QUESTIONS[1:3]),
            stream_text(client, question, prompt_cache_key="batched-session", prompt_cache_retention="24h"))

    call, *texts, session_text = asyncio.run(run())
    assert call.finish_reason == "tool_calls" and call.message.tool_calls[0].function.name == "get_weather"
    assert isinstance(json.loads(call.message.tool_calls[0].function.arguments)["city"], str)
    assert all(texts)
    assert session_text == reference.choices[0].message.content  # the session path gives the engine's greedy text
    assert metric(server.url, "justfit_batch_running_max") >= 2
    settle(server.url)
