"""`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`: OpenAI's Responses API as a thin front on
the chat path (responses_input.py builds the ChatRequest; prompts.chat_prompt, Server.submit and
flow.run_job do the rest) and responses_output.py renders the parts.

State: a stored response (`store`, default true) keeps its conversation in response_store.py. Its turn
runs as a persisted session named after the first response of the conversation (or `prompt_cache_key`),
so a `previous_response_id` follow-up prefills only its new input, after a restart too.
"""

import asyncio
import json
import time
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from . import prompts
from .deltas import Reply
from .errors import APIError
from .flow import cancel_on_disconnect, run_job
from .response_store import ResponseStore, new_id
from .responses_input import chat_request
from .responses_output import Output
from .responses_schema import ResponsesRequest

router = APIRouter()
OMIT = ("user", "prompt_cache_key", "usage")  # optional in OpenAI's spec but not nullable: left out when unset


def _store(request: Request) -> ResponseStore:
    state = request.app.state
    if getattr(state, "responses", None) is None:
        state.responses = ResponseStore(Path(state.server.home) / "responses")
    return state.responses


def _not_found(rid: str) -> APIError:
    return APIError(404, f"Response with id '{rid}' not found.", "response_id", "not_found")


def _refuse(req: ResponsesRequest):
    if req.background:
        raise APIError(400, "background responses are not supported: send the request and wait (or stream)",
                       "background", "unsupported_parameter")
    if req.conversation is not None:
        raise APIError(400, "the Conversations API is not served: use previous_response_id or send the whole "
                       "input", "conversation", "unsupported_parameter")


def _session(req: ResponsesRequest, prev, rid: str, store: bool):
    """(session name, retention): prompt_cache_key as in chat; else the conversation's persisted session,
    named after its first stored response; none when nothing is stored (the prefix index still reuses)."""
    if req.prompt_cache_key is not None:
        return req.prompt_cache_key, req.prompt_cache_retention
    if prev is not None and prev.get("session"):
        return prev["session"], prev.get("retention")
    return (rid, "24h") if store else (None, None)


def _skeleton(req: ResponsesRequest, srv, rid: str, chat, store: bool) -> dict:
    """The Response object before any output: the request's settings echoed as OpenAI does."""
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True, exclude_unset=True) if req.text and req.text.format else None
    out = {"id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "background": False, "error": None, "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "model": srv.model_id, "output": [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "service_tier": "default", "store": store,
            "temperature": chat.temperature, "text": {"format": fmt or {"type": "text"}},
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "top_p": chat.top_p,
            "truncation": req.truncation or "disabled", "usage": None, "user": req.user,
            "metadata": req.metadata or {}, "prompt_cache_key": req.prompt_cache_key}
    return {k: v for k, v in out.items() if v is not None or k not in OMIT}


def _max_new(chat, context: int, n_prompt: int) -> int:
    try:
        return prompts.max_new(chat, context, n_prompt)
    except APIError as e:
        raise APIError(400, e.message.replace("shorten the messages or lower max_tokens",
                                              "shorten the input or lower max_output_tokens"),
                       "input", e.code) from None


@router.post("/v1/responses")
async def create_response(req: ResponsesRequest, request: Request):
    srv = await request.app.state.server.use(req.model)
    _refuse(req)
    store, rid = _store(request), new_id()
    prev = None
    if req.previous_response_id is not None:
        prev = store.load(req.previous_response_id)
        if prev is None:
            raise APIError(400, f"Previous response with id '{req.previous_response_id}' not found.",
                           "previous_response_id", "previous_response_not_found")
    keep = req.store is not False
    history = prev["messages"] if prev else []
    session, retention = _session(req, prev, rid, keep)
    chat, new = chat_request(req, history, session, retention)
    ids, tools, syntax, grammar = prompts.chat_prompt(srv.rt, chat)
    srv = await request.app.state.server.ready(srv, len(ids))
    job = srv.submit(chat, ids, _max_new(chat, srv.context, len(ids)), grammar)
    reply = Reply(syntax, bool(tools))
    out = Output(_skeleton(req, srv, rid, chat, keep), reply.id)
    record = {"id": rid, "created_at": out.response["created_at"], "session": session, "retention": retention,
              "messages": history + new} if keep else None
    events = _events(job, reply, out, record, store, request)
    if req.stream:
        return StreamingResponse(_sse(events, job, out), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
    async with cancel_on_disconnect(request, [job]):
        async for _ in events:
            pass
    return JSONResponse(out.response)


async def _events(job, reply: Reply, out: Output, record, store: ResponseStore, request: Request):
    """Every event of one response; the response is stored before its last event goes out."""
    for ev in out.start():
        yield ev
    async for kind, value in run_job(job, reply, request):
        if kind == "part":
            for ev in out.part(*value):
                yield ev
            continue
        call, stats = value
        events = out.done(call, stats, len(job.prompt))
        if record is not None:
            record.update(messages=record["messages"] + [out.assistant_message()], response=out.response)
            await asyncio.to_thread(store.save, record)
        for ev in events:
            yield ev


def _line(ev: dict) -> str:
    return f"event: {ev['type']}\ndata: {json.dumps(ev, ensure_ascii=False)}\n\n"


async def _sse(events, job, out: Output):
    """Server-sent events, `event: TYPE` then `data: {...}`; an error after the start is response.failed.
    A client that goes away closes this generator, which cancels the job."""
    try:
        async for ev in events:
            yield _line(ev)
    except APIError as e:
        yield _line(out.failed(e.status, e.message))
    finally:
        job.cancelled.set()
        await events.aclose()


@router.get("/v1/responses/{rid}")
async def get_response(rid: str, request: Request):
    record = _store(request).load(rid)
    if record is None:
        raise _not_found(rid)
    return JSONResponse(record["response"])


@router.delete("/v1/responses/{rid}")
async def delete_response(rid: str, request: Request):
    if not _store(request).delete(rid):
        raise _not_found(rid)
    return {"id": rid, "object": "response", "deleted": True}
