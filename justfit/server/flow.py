"""What every API front does with a submitted job, whatever its wire format: read the job's events as reply
parts (text, tool-call name, argument fragments) and its closing stats, and cancel the jobs of a client
that goes away. The fronts (routes.py for OpenAI chat and completions, and the other protocols' modules)
only translate requests in and these parts out."""

import asyncio
from contextlib import asynccontextmanager

from fastapi import Request

from .deltas import Reply
from .errors import APIError


async def run_job(job, reply: Reply, request: Request):
    """Parts of one reply as they come (the Reply turns text into content or a tool call):
    ('part', (kind, text))..., then ('done', (call, stats))."""
    srv = request.app.state.server
    async for kind, value in job.events():
        if kind == "chunk":
            for part in reply.add(value.text):
                yield "part", part
        elif kind == "error":
            raise value if isinstance(value, APIError) else APIError(500, f"generation failed: {value}")
        else:
            parts, call = reply.finish()
            for part in parts:
                yield "part", part
            srv.account(request, job, value)
            yield "done", (call, value)


@asynccontextmanager
async def cancel_on_disconnect(request: Request, jobs):
    """While a non-streamed reply is generated, watch the connection: a client that goes away cancels
    its jobs (their engine requests stop and free their pages at the next step)."""
    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        for j in jobs:
            j.cancelled.set()

    task = asyncio.create_task(watch())
    try:
        yield
    finally:
        task.cancel()
