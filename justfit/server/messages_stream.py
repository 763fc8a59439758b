"""A Messages reply as Anthropic's server-sent events: message_start, ping, then per content block
content_block_start / content_block_delta (text_delta, or input_json_delta for a tool_use's input) /
content_block_stop, then message_delta (stop_reason, usage) and message_stop. A failure after the
stream began is an `error` event with Anthropic's error body."""

import json

from fastapi import Request
from fastapi.responses import StreamingResponse

from .deltas import Reply
from .errors import APIError, anthropic_envelope
from .flow import run_job
from .messages_schema import OutUsage


def tool_id(reply: Reply) -> str:
    return "toolu_" + reply.id.removeprefix("call_")


def stop_reason(call, stats: dict) -> str:
    if call is not None:
        return "tool_use"
    if stats.get("finish_reason") == "length":
        return "max_tokens"
    return "stop_sequence" if stats.get("stop_sequence") else "end_turn"


def usage(n_prompt: int, stats: dict) -> OutUsage:
    cached = stats.get("reused_tokens", 0)
    return OutUsage(input_tokens=n_prompt - cached, output_tokens=stats.get("generated_tokens", 0),
                    cache_read_input_tokens=cached)


def event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _events(model: str, mid: str, n_prompt: int, job, reply: Reply, request: Request):
    """The events of one reply. The first engine event is awaited before message_start, so a request the
    engine refuses keeps its HTTP status."""
    parts = run_job(job, reply, request)
    first = await parts.__anext__()
    start = {"id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
             "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": n_prompt, "output_tokens": 0, "cache_creation_input_tokens": 0,
                       "cache_read_input_tokens": 0}}
    yield event("message_start", {"type": "message_start", "message": start})
    yield event("ping", {"type": "ping"})
    index, open_kind = -1, None

    async def all_parts():
        yield first
        async for p in parts:
            yield p

    async for kind, value in all_parts():
        if kind == "done":
            call, stats = value
            if open_kind is not None:
                yield event("content_block_stop", {"type": "content_block_stop", "index": index})
            out = usage(n_prompt, stats).model_dump()
            delta = {"stop_reason": stop_reason(call, stats), "stop_sequence": stats.get("stop_sequence")}
            yield event("message_delta", {"type": "message_delta", "delta": delta, "usage": out})
            yield event("message_stop", {"type": "message_stop"})
            return
        what, text = value
        if what == "call":
            if open_kind is not None:
                yield event("content_block_stop", {"type": "content_block_stop", "index": index})
            index, open_kind = index + 1, "tool_use"
            block = {"type": "tool_use", "id": tool_id(reply), "name": text, "input": {}}
            yield event("content_block_start", {"type": "content_block_start", "index": index, "content_block": block})
            continue
        if not text:
            continue
        if open_kind is None:
            index, open_kind = index + 1, "text"
            yield event("content_block_start", {"type": "content_block_start", "index": index,
                                                "content_block": {"type": "text", "text": ""}})
        delta = {"type": "text_delta", "text": text} if open_kind == "text" else \
            {"type": "input_json_delta", "partial_json": text}
        yield event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})


async def sse(model: str, mid: str, n_prompt: int, job, reply: Reply, request: Request) -> StreamingResponse:
    """A text/event-stream response; a client that disconnects closes the generator, which cancels the job."""
    events = _events(model, mid, n_prompt, job, reply, request)
    first = await events.__anext__()

    async def body():
        try:
            yield first
            async for e in events:
                yield e
        except APIError as e:
            yield event("error", anthropic_envelope(e.status, e.message))
        finally:
            job.cancelled.set()
            await events.aclose()

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
