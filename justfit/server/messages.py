"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) on the chat completions path:
the request becomes a ChatRequest (system, text, tool_use and tool_result blocks, tools, tool_choice,
sampling), which runs through prompts.chat_prompt, Server.submit and flow.run_job like any chat request;
the reply parts are rendered as a message object or as Anthropic's SSE events (messages_stream.py).
Claude clients name claude-* models: every such name is served by the one model here (API.md, "Messages")."""

import json
import uuid
from typing import List, Optional

from fastapi import APIRouter, Request
from pydantic import ValidationError

from . import prompts
from .deltas import Reply
from .errors import APIError
from .flow import cancel_on_disconnect, run_job
from .messages_schema import Block, CountRequest, InMessage, InTool, MessagesRequest, OutMessage
from .messages_stream import sse, stop_reason, tool_id, usage
from .schema import ChatRequest, FunctionCall, FunctionDef, Message, NamedFunction, NamedToolChoice, Tool, ToolCall

router = APIRouter()
# Tools Anthropic's own servers run: not run here, and left out of the prompt (the model answers without them).
SERVER_TOOLS = ("web_search_", "web_fetch_", "code_execution_")
IGNORED_BLOCKS = ("thinking", "redacted_thinking")  # earlier turns' reasoning: not shown to this model
CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# A system block for Anthropic's accounting, not for the model; Claude Code's varies with the prompt, so
# leaving it out keeps the system prompt a stable prefix that the next request reuses.
BILLING = "x-anthropic-billing-header:"
UNIMPLEMENTED = "Unimplemented keys: "
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _srv(request: Request):
    return request.app.state.server


async def check_model(srv, name: str):
    """The served model of that name; any claude-* name (what Anthropic clients send, for large and small
    models alike) is the primary one. Loaded on first use."""
    if srv.pool.find(name) is None and not name.startswith("claude"):
        raise APIError(404, f"model: {name!r} is not served here; this server serves {srv.model_id!r} "
                       "(and any claude-* name as an alias of it)", "model")
    return await srv.use(None if srv.pool.find(name) is None else name, status=404)


def _texts(blocks, where: str) -> str:
    """The text of a list of text blocks (dicts or Blocks); a 400 naming any other block."""
    out = []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else b.type
        text = b.get("text") if isinstance(b, dict) else b.text
        if kind == "text" and isinstance(text, str):
            out.append(text)
        elif kind not in IGNORED_BLOCKS:
            raise APIError(400, f"{where}[{j}]: content block type {kind!r} is not supported here: this model reads "
                           "text only", f"{where}[{j}].type")
    return "\n".join(out)


def _texts_or_str(content, where: str) -> str:
    return content if isinstance(content, str) else _texts(content, where)


def _user(m: InMessage, i: int) -> List[Message]:
    """A user turn: its tool_result blocks as tool messages, its text as one user message, in block order."""
    if isinstance(m.content, str):
        return [Message(role="user", content=m.content)]
    out, text = [], []
    for j, b in enumerate(m.content):
        where = f"messages[{i}].content[{j}]"
        if b.type == "tool_result":
            body = b.content if isinstance(b.content, str) else _texts(b.content or [], where + ".content")
            out.append(Message(role="tool", tool_call_id=b.tool_use_id, content=("Error: " if b.is_error else "") + body))
        else:
            text.append(_block_text(b, i, j))
    if any(text):
        out.append(Message(role="user", content="\n".join(filter(None, text))))
    return out


def _assistant(m: InMessage, i: int) -> Message:
    """An assistant turn: its text, and its tool_use blocks as tool calls."""
    if isinstance(m.content, str):
        return Message(role="assistant", content=m.content)
    text, calls = [], []
    for j, b in enumerate(m.content):
        if b.type == "tool_use":
            if not b.id or not b.name:
                raise APIError(400, f"messages[{i}].content[{j}]: a tool_use block needs id and name",
                               f"messages[{i}].content[{j}]")
            calls.append(ToolCall(id=b.id, function=FunctionCall(name=b.name, arguments=json.dumps(b.input or {}))))
        else:
            text.append(_block_text(b, i, j))
    return Message(role="assistant", content="".join(text), tool_calls=calls or None)


def _block_text(b: Block, i: int, j: int) -> str:
    """A text block's text, "" for a block this model ignores, a 400 for any other."""
    if b.type in IGNORED_BLOCKS:
        return ""
    if b.type == "text" and b.text is not None:
        return b.text
    raise APIError(400, f"messages[{i}].content[{j}]: content block type {b.type!r} is not supported here: this "
                   "model reads text only", f"messages[{i}].content[{j}].type")


def _tool(t: InTool, i: int) -> Optional[Tool]:
    """A custom tool as a chat tool; None for a tool Anthropic's servers run; a 400 for other typed tools."""
    if t.type not in (None, "custom"):
        if t.type.startswith(SERVER_TOOLS):
            return None
        raise APIError(400, f"tools[{i}]: tool type {t.type!r} is not supported here; define it as a custom tool "
                       "(name, description, input_schema)", f"tools[{i}].type")
    if t.input_schema is None:
        raise APIError(400, f"tools[{i}]: a custom tool needs input_schema", f"tools[{i}].input_schema")
    return Tool(function=FunctionDef(name=t.name, description=t.description, parameters=enforceable(t.input_schema)))


def enforceable(schema: dict) -> dict:
    """The schema without the keywords the grammar compiler does not implement (Claude Code's tools use
    propertyNames, for one): the reply's JSON keeps the schema's shape, and those rules go unchecked."""
    import llguidance as llg

    probe = {**schema, "x-guidance": {"lenient": True}}
    _, notes = llg.LLMatcher.validate_grammar_with_warnings("start: %json " + json.dumps(probe) + "\n")
    keys = {k for n in notes if n.startswith(UNIMPLEMENTED) for k in json.loads(n[len(UNIMPLEMENTED):])}
    return _without(schema, keys) if keys else schema


def _without(node, keys: set, names: bool = False):
    """`node` without the schema keywords `keys`; `names`: node maps property names to schemas (kept)."""
    if isinstance(node, list):
        return [_without(v, keys) for v in node]
    if not isinstance(node, dict):
        return node
    return {k: _without(v, keys, not names and k in SCHEMA_MAPS) for k, v in node.items() if names or k not in keys}


def to_chat(req: CountRequest) -> ChatRequest:
    """The chat request this Messages request means (the one engine path serves both)."""
    messages = []
    if req.system:
        blocks = [req.system] if isinstance(req.system, str) else req.system
        kept = [b for b in blocks if isinstance(b, str) or not (b.text or "").startswith(BILLING)]
        system = "".join(b if isinstance(b, str) else _texts([b], "system") for b in kept)
        messages.append(Message(role="system", content=system))
    for i, m in enumerate(req.messages):
        if m.role == "user":
            messages += _user(m, i)
        elif m.role == "system":
            messages.append(Message(role="system", content=_texts_or_str(m.content, f"messages[{i}].content")))
        else:
            messages.append(_assistant(m, i))
    tools = [t for t in (_tool(t, i) for i, t in enumerate(req.tools or [])) if t is not None]
    fields = {"model": req.model, "messages": messages, "tools": tools or None, "tool_choice": _choice(req)}
    if isinstance(req, MessagesRequest):
        fields.update(max_tokens=req.max_tokens, stop=req.stop_sequences or None, top_k=req.top_k or None,
                      temperature=1.0 if req.temperature is None else req.temperature, top_p=req.top_p or 1.0)
    try:
        return ChatRequest(**fields)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise APIError(400, f"{where}: {first['msg']}" if where else first["msg"]) from None


def _choice(req: CountRequest):
    c = req.tool_choice
    if c is None:
        return None
    if c.type != "tool":
        return CHOICES[c.type]
    if not c.name:
        raise APIError(400, "tool_choice: type 'tool' needs a name", "tool_choice.name")
    return NamedToolChoice(function=NamedFunction(name=c.name))


def prefill(req: CountRequest) -> str:
    """The text of a final assistant message (no tool_use): the reply continues it ("" when there is none)."""
    last = req.messages[-1]
    if last.role != "assistant" or not isinstance(last.content, str) and any(b.type == "tool_use" for b in last.content):
        return ""
    text = _assistant(last, len(req.messages) - 1).content
    if text != text.rstrip():
        raise APIError(400, "final assistant content cannot end with trailing whitespace",
                       f"messages[{len(req.messages) - 1}].content")
    return text


def build(srv, req: CountRequest):
    """(ids, tools, syntax, grammar, chat request). A prefilled reply is text that continues the final
    assistant message: its tokens follow the generation prompt and no tool grammar applies."""
    chat, start = to_chat(req), prefill(req)
    if start:
        chat.messages = chat.messages[:-1]
    ids, tools, syntax, grammar = prompts.chat_prompt(srv.rt, chat)
    if start:
        ids, tools, grammar = ids + list(srv.rt.tokenizer.encode(start, add_special_tokens=False)), [], None
    return ids, tools, syntax, grammar, chat


def prompt_of(srv, req: CountRequest):
    """build(), with Anthropic's error for a prompt over the context."""
    ids, tools, syntax, grammar, chat = build(srv, req)
    if len(ids) >= srv.context:
        raise APIError(400, f"prompt is too long: {len(ids)} tokens > {srv.context - 1} maximum", "messages")
    return ids, tools, syntax, grammar, chat


@router.post("/v1/messages/count_tokens")
async def count_tokens(req: CountRequest, request: Request):
    srv = await check_model(_srv(request), req.model)
    return {"input_tokens": len(build(srv, req)[0])}


@router.post("/v1/messages")
async def messages(req: MessagesRequest, request: Request):
    srv = await check_model(_srv(request), req.model)
    ids, tools, syntax, grammar, chat = prompt_of(srv, req)
    srv = await _srv(request).ready(srv, len(ids))
    # Anthropic clients ask for large budgets (Claude Code: tens of thousands): the reply gets what fits
    job = srv.submit(chat, ids, min(req.max_tokens, srv.context - len(ids)), grammar)
    reply, mid = Reply(syntax, bool(tools)), "msg_" + uuid.uuid4().hex[:24]
    if req.stream:
        return await sse(srv.model_id, mid, len(ids), job, reply, request)
    call, stats = None, {}
    async with cancel_on_disconnect(request, [job]):
        async for kind, value in run_job(job, reply, request):
            if kind == "done":
                call, stats = value
    if call is not None:
        content = [{"type": "tool_use", "id": tool_id(reply), "name": call["name"], "input": json.loads(call["arguments"])}]
    else:
        content = [{"type": "text", "text": reply.text}] if reply.text else []
    return OutMessage(id=mid, model=srv.model_id, content=content, stop_reason=stop_reason(call, stats),
                      stop_sequence=stats.get("stop_sequence"), usage=usage(len(ids), stats))
