"""Ollama's generation routes, /api/chat and /api/generate, on the one engine path: each body becomes
the chat front's request (ollama_schema.engine_request) and runs through prompts.chat_prompt,
Server.submit and flow.run_job; the reply parts go out in Ollama's shapes, as NDJSON lines (Ollama
streams by default) or one JSON object. A prompt that does not fit the context is refused, never
truncated as Ollama would."""

import json
import re
import time
from typing import List, Optional

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from . import prompts
from .deltas import Reply
from .errors import APIError
from .flow import cancel_on_disconnect, run_job
from .ollama_info import iso, ollama_name
from .ollama_schema import ChatBody, GenerateBody, engine_request, read_body

router = APIRouter()
UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def keep_alive_seconds(value) -> Optional[float]:
    """keep_alive as seconds: a number of seconds or a Go duration ("5m", "1h30m", "0"); None (keep
    forever) when negative. A 400 for anything else."""
    if isinstance(value, (int, float)):
        return None if value < 0 else float(value)
    text = value.strip()
    sign = -1 if text.startswith("-") else 1
    body = text.lstrip("+-")
    try:
        seconds = float(body)
    except ValueError:
        parts = DURATION.findall(body)
        if not body or "".join(n + u for n, u in parts) != body:
            raise APIError(400, f"keep_alive: invalid duration {value!r} (a number of seconds, or e.g. \"5m\", \"1h\", \"0\")") from None
        seconds = sum(float(n) * UNITS[u] for n, u in parts)
    return None if sign < 0 else seconds


def _keep_alive(srv, body) -> Optional[float]:
    """Apply a request's keep_alive to the server; absent, the server's own (--idle-release), as Ollama
    falls back to its default. The seconds asked, or None when absent or forever."""
    worker = srv.worker
    seconds = worker.idle_default if body.keep_alive is None else keep_alive_seconds(body.keep_alive)
    if seconds != worker.idle_release:
        worker.keep_alive(seconds)
    return None if body.keep_alive is None else seconds


def budget(srv, options, n_prompt: int) -> int:
    """The reply's token budget: num_predict, else the rest of the context (Ollama's -1 and -2); the
    context is the model's or a smaller num_ctx. Prompt and budget over it: Ollama's 400."""
    context = srv.context
    if options.num_ctx is not None:
        if options.num_ctx > context:
            raise APIError(400, f"num_ctx {options.num_ctx} is over this model's context length of {context} tokens")
        context = options.num_ctx
    asked = options.num_predict if options.num_predict is not None and options.num_predict > 0 else None
    if n_prompt + (asked or 1) > context:
        raise APIError(400, f"the input length exceeds the context length: the prompt has {n_prompt} tokens, "
                       f"{asked or 1} more were requested and the context is {context} tokens (JustFit refuses "
                       "instead of truncating)")
    return asked or context - n_prompt


def chat_messages(body: ChatBody) -> List[dict]:
    """Ollama's messages as the chat front's: a tool call's arguments object as JSON text, a tool result
    as the reply of the tool it names (tool_name, else the last call made)."""
    out, last = [], None
    for i, m in enumerate(body.messages):
        if m.images:
            raise APIError(400, f"messages[{i}].images: this model reads text only")
        if m.role == "tool":
            name = m.tool_name or last
            if name is None:
                raise APIError(400, f"messages[{i}]: a tool message needs tool_name or an earlier tool call")
            out.append({"role": "function", "name": name, "content": m.content or ""})
            continue
        msg = {"role": m.role, "content": m.content or ""}
        if m.role == "assistant" and m.tool_calls:
            msg["tool_calls"] = [{"id": f"call_{i}_{j}", "type": "function", "function": {
                "name": c.function.name, "arguments": c.function.arguments if isinstance(c.function.arguments, str)
                else json.dumps(c.function.arguments, ensure_ascii=False)}} for j, c in enumerate(m.tool_calls)]
            last = m.tool_calls[-1].function.name
        out.append(msg)
    return out


class Turn:
    """One reply's timing and counts, for Ollama's closing fields (durations in nanoseconds)."""

    def __init__(self, srv, n_prompt: int, load_s: float = 0.0):
        self.srv, self.n_prompt, self.load_s, self.start = srv, n_prompt, load_s, time.perf_counter()

    def closing(self, call, stats: dict) -> dict:
        total = time.perf_counter() - self.start
        first = min(total, stats.get("ttft_s", 0.0))  # from submission: queue, prefill, first token
        reason = "length" if call is None and stats.get("finish_reason") == "length" else "stop"
        load = self.load_s + stats.get("reload_s", 0.0)  # loaded for it, or its weights brought back
        return {"done": True, "done_reason": reason, "total_duration": int((total + self.load_s) * 1e9),
                "load_duration": int(load * 1e9), "prompt_eval_count": self.n_prompt,
                "prompt_eval_duration": int(max(0.0, first - stats.get("queue_s", 0.0)) * 1e9),
                "eval_count": stats.get("generated_tokens", 0), "eval_duration": int((total - first) * 1e9)}


async def _resident(server, srv):
    """(the model a request names, made resident for it; seconds of the load it waited for, 0 when the model
    was loaded already): Ollama's load_duration, also part of its total_duration."""
    start, was = time.perf_counter(), srv.loaded
    srv = await server.use(srv.model_id)
    return srv, 0.0 if was else time.perf_counter() - start


def _head(srv) -> dict:
    return {"model": ollama_name(srv), "created_at": iso(time.time())}


@router.post("/api/chat")
async def chat(request: Request):
    body = await read_body(request, ChatBody)
    server = request.app.state.server
    srv = _find(server, body.model)
    if not body.messages:
        return await _load(server, srv, body, {"message": {"role": "assistant", "content": ""}})
    srv, load_s = await _resident(server, srv)
    _keep_alive(srv, body)
    req = engine_request(srv.model_id, chat_messages(body), body, body.tools)
    ids, tools, syntax, grammar = prompts.chat_prompt(srv.rt, req)
    srv = await server.ready(srv, len(ids))
    job = srv.submit(req, ids, budget(srv, body.options, len(ids)), grammar)
    reply, turn = Reply(syntax, bool(tools)), Turn(srv, len(ids), load_s)

    async def lines():
        async for kind, value in run_job(job, reply, request):
            if kind == "done":
                call, stats = value
                msg = {"role": "assistant", "content": "" if body.stream or call else reply.text}
                if call is not None:  # Ollama sends a call whole, with its arguments as an object
                    calls = [{"function": {"name": call["name"], "arguments": json.loads(call["arguments"])}}]
                    if body.stream:
                        yield {**_head(srv), "message": {**msg, "tool_calls": calls}, "done": False}
                    else:
                        msg["tool_calls"] = calls
                yield {**_head(srv), "message": msg, **turn.closing(call, stats)}
            elif value[0] == "content" and body.stream:
                yield {**_head(srv), "message": {"role": "assistant", "content": value[1]}, "done": False}

    return await _answer(lines(), [job], body.stream, request)


@router.post("/api/generate")
async def generate(request: Request):
    body = await read_body(request, GenerateBody)
    server = request.app.state.server
    srv = _find(server, body.model)
    for field in ("suffix", "template", "images", "context"):
        if getattr(body, field):
            raise APIError(400, f"{field} is not supported by JustFit (see API.md, Ollama)")
    if not body.prompt:
        return await _load(server, srv, body, {"response": ""})
    srv, load_s = await _resident(server, srv)
    _keep_alive(srv, body)
    messages = ([{"role": "system", "content": body.system}] if body.system else []) + \
               [{"role": "user", "content": body.prompt}]
    req = engine_request(srv.model_id, messages, body)
    if body.raw:  # the prompt as is: no chat template, no system
        ids = list(srv.rt.tokenizer.encode(body.prompt))
        grammar = prompts.response_grammar(req) if req.response_format is not None else None
    else:
        ids, _, _, grammar = prompts.chat_prompt(srv.rt, req)
    srv = await server.ready(srv, len(ids))
    job = srv.submit(req, ids, budget(srv, body.options, len(ids)), grammar)
    reply, turn = Reply(), Turn(srv, len(ids), load_s)

    async def lines():
        async for kind, value in run_job(job, reply, request):
            if kind == "done":
                yield {**_head(srv), "response": "" if body.stream else reply.text, **turn.closing(*value)}
            elif body.stream:
                yield {**_head(srv), "response": value[1], "done": False}

    return await _answer(lines(), [job], body.stream, request)


def _find(server, name: Optional[str]):
    """The served model an Ollama body names (with or without ':latest'); Ollama's 404 otherwise."""
    s = server.pool.find(name or "")
    if s is None:
        raise APIError(404, f"model '{name}' not found")
    return s


async def _load(server, srv, body, empty: dict) -> dict:
    """A body with no prompt (Ollama's load and unload calls): keep_alive 0 unloads the model now (its
    sessions checkpointed); otherwise it is loaded (room made under the budget) and keeps keep_alive."""
    import asyncio

    from .models_routes import wait_idle

    kept = None if body.keep_alive is None else keep_alive_seconds(body.keep_alive)
    if kept == 0:
        await wait_idle(srv)
        await asyncio.to_thread(server.pool.unload, srv)
    else:
        srv = await server.use(srv.model_id)
        _keep_alive(srv, body)
    return {**_head(srv), **empty, "done": True, "done_reason": "unload" if kept == 0 else "load"}


async def _answer(lines, jobs, stream: bool, request: Request):
    """One JSON object (the last line, which holds the whole reply), or the lines as NDJSON. The first
    line is awaited here so that a failure before any output keeps its HTTP status."""
    if not stream:
        last = None
        async with cancel_on_disconnect(request, jobs):
            async for line in lines:
                last = line
        return last
    first = await lines.__anext__()

    async def body():
        try:
            yield json.dumps(first) + "\n"
            async for line in lines:
                yield json.dumps(line) + "\n"
        except APIError as e:
            yield json.dumps({"error": e.message}) + "\n"
        finally:
            for j in jobs:
                j.cancelled.set()
            await lines.aclose()

    return StreamingResponse(body(), media_type="application/x-ndjson")
