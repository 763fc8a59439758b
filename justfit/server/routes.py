"""The routes: validate (pydantic + prompts.py), submit to the worker, answer or stream (SSE)."""

import json
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from . import prompts
from .deltas import Reply
from .errors import APIError, envelope
from .flow import cancel_on_disconnect, run_job
from .schema import (ChatCompletion, ChatCompletionChunk, ChatRequest, Choice, ChunkChoice, Completion,
                     CompletionRequest, Delta, Model, ModelList, OutMessage, PromptDetails, TextChoice, ToolCall,
                     ToolCallDelta, Usage)

router = APIRouter()
FINISH = {"stop": "stop", "length": "length", "grammar": "stop"}


def _srv(request: Request):
    return request.app.state.server


@router.get("/health")
async def health(request: Request):
    srv = _srv(request)
    return {"status": "ok", "model": srv.model_id, "queue_length": sum(s.worker.queue_length for s in srv.loaded()),
            "loaded": [s.model_id for s in srv.loaded()], "uptime_s": round(time.time() - srv.started, 1)}


@router.get("/metrics")
async def metrics(request: Request):
    srv = _srv(request)
    loaded = [m for m in srv.loaded() if m.rt is not None and m.worker is not None]
    text = srv.metrics.render([(m.model_id, m.rt, m.worker.snapshot()) for m in loaded])
    if srv.gate is not None:  # set when uvicorn serves the app through conns.py
        text += "\n".join(srv.gate.metric_lines()) + "\n"
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request):
    srv = _srv(request)
    return ModelList(data=[Model(id=s.model_id, created=int(s.started)) for s in srv.models()])


@router.get("/v1/models/{model_id:path}", response_model=Model)
async def get_model(model_id: str, request: Request):
    s = _srv(request).find(model_id, status=404)
    return Model(id=s.model_id, created=int(s.started))


def _usage(jobs, stats) -> Usage:
    prompt = sum(len(j.prompt) for j in jobs)
    completion = sum(s.get("generated_tokens", 0) for s in stats)
    cached = sum(s.get("reused_tokens", 0) for s in stats)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptDetails(cached_tokens=cached))


def _finish(call, stats) -> str:
    return "tool_calls" if call is not None else FINISH.get(stats.get("finish_reason"), "stop")


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatRequest, request: Request):
    srv = await _srv(request).use(req.model)
    ids, tools, syntax, grammar = prompts.chat_prompt(srv.rt, req)
    srv = await _srv(request).ready(srv, len(ids))  # room for its KV and workspace too
    max_tokens = prompts.max_new(req, srv.context, len(ids))
    jobs = [srv.submit(req, ids, max_tokens, grammar) for _ in range(req.n)]
    rid = "chatcmpl-" + uuid.uuid4().hex
    replies = [Reply(syntax, bool(tools)) for _ in jobs]
    if req.stream:
        return await _sse(_chat_chunks(srv, req, rid, jobs, replies, request), jobs)
    choices, stats = [], []
    async with cancel_on_disconnect(request, jobs):
        for i, (job, reply) in enumerate(zip(jobs, replies)):
            async for kind, value in run_job(job, reply, request):
                if kind == "done":
                    call, st = value
                    stats.append(st)
                    calls = [ToolCall(id=reply.id, function=call)] if call else None
                    msg = OutMessage(content=None if call else reply.text, tool_calls=calls)
                    choices.append(Choice(index=i, message=msg, finish_reason=_finish(call, st)))
    return ChatCompletion(id=rid, model=srv.model_id, choices=choices, usage=_usage(jobs, stats))


async def _chat_chunks(srv, req: ChatRequest, rid: str, jobs, replies, request: Request):

    def chunk(i, delta, finish=None):
        return ChatCompletionChunk(id=rid, model=srv.model_id, choices=[ChunkChoice(index=i, delta=delta, finish_reason=finish)])

    stats = []
    for i, (job, reply) in enumerate(zip(jobs, replies)):
        yield chunk(i, Delta(role="assistant", content=""))
        async for kind, value in run_job(job, reply, request):
            if kind == "done":
                call, st = value
                stats.append(st)
                yield chunk(i, Delta(), _finish(call, st))
                continue
            what, text = value
            if what == "content":
                yield chunk(i, Delta(content=text))
            elif what == "call":
                yield chunk(i, Delta(tool_calls=[ToolCallDelta(index=0, id=reply.id, type="function",
                                                               function={"name": text, "arguments": ""})]))
            elif text:
                yield chunk(i, Delta(tool_calls=[ToolCallDelta(index=0, function={"arguments": text})]))
    if req.stream_options and req.stream_options.include_usage:
        yield ChatCompletionChunk(id=rid, model=srv.model_id, choices=[], usage=_usage(jobs, stats))


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request):
    srv = await _srv(request).use(req.model)
    if req.suffix:
        raise APIError(400, "suffix (fill-in-the-middle) is not supported", "suffix", "unsupported_parameter")
    ids = prompts.completion_prompt(srv.rt, req)
    srv = await _srv(request).ready(srv, len(ids))
    max_tokens = prompts.max_new(req, srv.context, len(ids), default=16)  # OpenAI's default for completions
    jobs = [srv.submit(req, ids, max_tokens, None) for _ in range(req.n)]
    rid = "cmpl-" + uuid.uuid4().hex
    head = srv.rt.tokenizer.decode(ids) if req.echo else ""
    if req.stream:
        return await _sse(_text_chunks(srv, req, rid, jobs, head, request), jobs)
    choices, stats = [], []
    async with cancel_on_disconnect(request, jobs):
        for i, job in enumerate(jobs):
            reply = Reply()
            async for kind, value in run_job(_Continued(job, srv.rt.tokenizer), reply, request):
                if kind == "done":
                    stats.append(value[1])
                    choices.append(TextChoice(index=i, text=head + reply.text, finish_reason=_finish(None, value[1])))
    return Completion(id=rid, model=srv.model_id, choices=choices, usage=_usage(jobs, stats))


async def _text_chunks(srv, req: CompletionRequest, rid: str, jobs, head: str, request: Request):
    stats = []
    for i, job in enumerate(jobs):
        if head:
            yield Completion(id=rid, model=srv.model_id, choices=[TextChoice(index=i, text=head, finish_reason=None)])
        async for kind, value in run_job(_Continued(job, srv.rt.tokenizer), Reply(), request):
            if kind == "done":
                stats.append(value[1])
                yield Completion(id=rid, model=srv.model_id,
                                 choices=[TextChoice(index=i, text="", finish_reason=_finish(None, value[1]))])
            else:
                yield Completion(id=rid, model=srv.model_id, choices=[TextChoice(index=i, text=value[1], finish_reason=None)])
    if req.stream_options and req.stream_options.include_usage:
        yield Completion(id=rid, model=srv.model_id, choices=[], usage=_usage(jobs, stats))


class _Continued:
    """A text-completion job whose first text keeps its leading space. The streaming detokenizer drops the
    space a reply's first token starts with (right for a chat message, which starts fresh); a text
    completion continues its prompt, so "Once upon a" must go on with " time", not "time"."""

    def __init__(self, job, tokenizer):
        self._job, self._tokenizer = job, tokenizer

    def __getattr__(self, name):
        return getattr(self._job, name)

    async def events(self):
        ids, started = [], False
        async for kind, value in self._job.events():
            if kind == "chunk" and not started:
                if value.token >= 0:
                    ids.append(value.token)
                if value.text:
                    started = True
                    whole = self._tokenizer.decode(ids) if ids else ""
                    if whole.startswith(" ") and not value.text.startswith(" "):
                        value = type(value)(" " + value.text, value.token)
            yield kind, value


async def _sse(chunks, jobs):
    """A text/event-stream response; the first chunk is awaited here so early failures keep their
    HTTP status. A client that disconnects closes the generator, which cancels every job."""
    first = await chunks.__anext__()

    async def body():
        try:
            yield f"data: {first.model_dump_json()}\n\n"
            async for c in chunks:
                yield f"data: {c.model_dump_json()}\n\n"
            yield "data: [DONE]\n\n"
        except APIError as e:
            yield f"data: {json.dumps(envelope(e.status, e.message, e.param, e.code))}\n\n"
        finally:
            for j in jobs:
                j.cancelled.set()
            await chunks.aclose()

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
