"""The Messages SSE writer without a model: a failure after the stream began is an `event: error` with
Anthropic's body (the stream then ends), and a failure before the first event keeps its HTTP status."""

import asyncio
import json
import threading
from types import SimpleNamespace

import pytest

from justfit.server.deltas import Reply
from justfit.server.errors import APIError
from justfit.server.messages_stream import sse


class Job:
    """A job whose engine events are scripted."""

    def __init__(self, *events):
        self.script, self.cancelled = events, threading.Event()

    async def events(self):
        for e in self.script:
            yield e


REQUEST = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(server=SimpleNamespace(account=lambda *a: None))))


async def _body(job):
    response = await sse("m", "msg_1", 10, job, Reply(), REQUEST)
    return "".join([chunk async for chunk in response.body_iterator])


def test_error_after_the_stream_began_is_an_error_event():
    job = Job(("chunk", SimpleNamespace(text="Hel")), ("error", APIError(503, "out of memory budget")))
    text = asyncio.run(_body(job))
    events = [line[7:] for line in text.splitlines() if line.startswith("event: ")]
    assert events == ["message_start", "ping", "content_block_start", "content_block_delta", "error"]
    last = json.loads(text.strip().splitlines()[-1][6:])
    assert last == {"type": "error", "error": {"type": "overloaded_error", "message": "out of memory budget"}}
    assert job.cancelled.is_set()


def test_error_before_the_first_event_keeps_its_status():
    with pytest.raises(APIError) as e:
        asyncio.run(_body(Job(("error", APIError(400, "max_tokens must be an integer >= 1")))))
    assert e.value.status == 400
