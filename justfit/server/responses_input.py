"""A Responses request -> the chat request the engine path takes (prompts.chat_prompt, Server.submit).

`input` items become chat messages (message -> its role, function_call -> an assistant tool call,
function_call_output -> a tool message, reasoning -> dropped); flat function tools become chat tools;
`text.format` becomes `response_format`; `instructions` becomes a first system message (not kept in the
stored conversation: OpenAI does not carry instructions over to a `previous_response_id` follow-up).
Tool types other than `function` are left out of the prompt (API.md lists them and why).
"""

from typing import List, Optional, Tuple

from pydantic import ValidationError

from .errors import APIError
from .responses_schema import FunctionTool, ResponsesRequest
from .schema import ChatRequest

TEXT_PARTS = ("input_text", "output_text", "text")
DROPPED_ITEMS = ("reasoning",)  # a local model has no hidden reasoning to resume: accepted, left out
# tool types the API defines that JustFit leaves out of the prompt: hosted tools run on OpenAI's servers,
# and the others are not JSON function calls, the one call shape the grammar enforces
IGNORED_TOOLS = ("web_search", "web_search_preview", "file_search", "code_interpreter", "image_generation",
                 "computer_use_preview", "computer", "mcp", "local_shell", "shell", "apply_patch", "custom",
                 "namespace", "tool_search")


def _error(message: str, param: Optional[str], code: str = "invalid_value") -> APIError:
    return APIError(400, message, param, code)


def text_of(content, where: str) -> str:
    """A content value's text: a string or its text parts; images, files and audio are a clear 400."""
    if content is None or isinstance(content, str):
        return content or ""
    out = []
    for j, part in enumerate(content):
        if part.type in TEXT_PARTS:
            out.append(part.text or "")
        elif part.type != "refusal":
            raise _error(f"content part type {part.type!r} is not supported: this model reads text only",
                         f"{where}[{j}].type", "unsupported_content")
    return "".join(out)


def _call_ids(messages: List[dict]) -> set:
    return {c["id"] for m in messages for c in m.get("tool_calls") or []}


def input_messages(req: ResponsesRequest, history: List[dict]) -> List[dict]:
    """The request's `input` as chat message dicts, checked against the conversation so far."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: List[dict] = []
    known = _call_ids(history)
    for i, item in enumerate(req.input or []):
        kind, where = item.type or "message", f"input[{i}]"
        if kind == "message":
            if item.role is None:
                raise _error("a message item needs a role (user, assistant, system or developer)", f"{where}.role")
            out.append({"role": item.role, "content": text_of(item.content, f"{where}.content")})
        elif kind == "function_call":
            if not item.call_id or not item.name:
                raise _error("a function_call item needs call_id and name", where)
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments or "{}"}}
            known.add(item.call_id)
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if item.call_id not in known:
                raise _error(f"function_call_output answers call_id {item.call_id!r}, which no earlier "
                             "function_call made", f"{where}.call_id")
            output = item.output if isinstance(item.output, (str, list)) else ""
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": text_of(output, f"{where}.output")})
        elif kind not in DROPPED_ITEMS:
            raise _error(f"input item type {kind!r} is not supported (message, function_call, "
                         "function_call_output and reasoning are)", f"{where}.type", "unsupported_value")
    return out


def chat_tools(req: ResponsesRequest) -> List[dict]:
    """The function tools in chat's shape; other tool types are left out (IGNORED_TOOLS and any unknown)."""
    out = []
    for i, t in enumerate(req.tools or []):
        if t.get("type") != "function":
            continue
        try:
            f = FunctionTool.model_validate(t)
        except ValidationError as e:
            first = e.errors()[0]
            loc = ".".join(str(x) for x in first.get("loc", ()))
            raise _error(f"tools[{i}]{'.' + loc if loc else ''}: {first['msg']}", f"tools[{i}]") from None
        fn = {"name": f.name, "description": f.description or ""}
        if f.parameters is not None:
            fn["parameters"] = f.parameters
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(req: ResponsesRequest, tools: List[dict]):
    """auto / none / required, or {"type": "function", "name"} -> chat's named choice."""
    choice = req.tool_choice
    if choice is None or isinstance(choice, str):
        return choice if tools or choice != "auto" else None
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _error(f"tool_choice {choice.get('type')!r} is not supported: JustFit runs function tools only "
                 "(auto, none, required or {\"type\": \"function\", \"name\"})", "tool_choice", "unsupported_value")


def response_format(req: ResponsesRequest) -> Optional[dict]:
    fmt = req.text.format if req.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise _error("text.format json_schema needs schema", "text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}


def chat_request(req: ResponsesRequest, history: List[dict], session: Optional[str],
                 retention: Optional[str]) -> Tuple[ChatRequest, List[dict]]:
    """(the chat request to run, the request's input as chat messages for the stored conversation)."""
    new = input_messages(req, history)
    head = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if not history and not new:
        raise _error("input is empty: send a string or a list of items", "input")
    tools = chat_tools(req)
    body = {"model": req.model, "messages": head + history + new, "tools": tools or None,
            "tool_choice": chat_tool_choice(req, tools), "parallel_tool_calls": req.parallel_tool_calls,
            "response_format": response_format(req), "max_completion_tokens": req.max_output_tokens,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p, "prompt_cache_key": session,
            "prompt_cache_retention": retention, "user": req.user}
    try:
        return ChatRequest.model_validate({k: v for k, v in body.items() if v is not None}), new
    except ValidationError as e:  # a stored conversation or a translated value out of chat's bounds
        first = e.errors()[0]
        raise _error(f"{'.'.join(str(x) for x in first.get('loc', ()))}: {first['msg']}", None) from None

