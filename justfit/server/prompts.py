"""From an OpenAI request to what the engine takes: prompt token ids, sampling options and the
grammar constraint (tools, tool_choice, response_format), with a 400 for anything we cannot honour."""

import json
from typing import List

from ..models.vocab import vocab_size
from ..grammar import answer_grammar, check_grammar, json_grammar, lark_grammar
from ..toolcalls import FINISH_TEXT, detect
from .errors import APIError
from .limits import LimitError, parse_json
from .schema import ChatRequest, CompletionRequest, Message

DEFAULT_MAX_TOKENS = 512
MAX_STRING = 500  # chars per string argument of a constrained tool call


def text_of(m: Message, i: int) -> str:
    """A message's text: a string or its text parts; a clear 400 for images and audio."""
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    out = []
    for j, part in enumerate(m.content):
        if part.type in ("text", "input_text", "output_text") and part.text is not None:
            out.append(part.text)
        elif part.type == "refusal":
            continue
        else:
            raise APIError(400, f"content part type {part.type!r} is not supported: this model reads text only",
                           f"messages[{i}].content[{j}].type", "unsupported_content")
    return "".join(out)


def chat_messages(req: ChatRequest, syntax) -> List[dict]:
    """The conversation as {'role', 'content'} dicts in the model's tool syntax."""
    names, out = {}, []
    for i, m in enumerate(req.messages):
        text = text_of(m, i)
        if m.role in ("system", "developer"):
            out.append({"role": "system", "content": text})
        elif m.role == "user":
            out.append({"role": "user", "content": text})
        elif m.role == "assistant":
            calls = []
            for c in m.tool_calls or []:
                names[c.id] = c.function.name
                try:
                    args = parse_json(c.function.arguments or "{}")
                except json.JSONDecodeError:
                    raise APIError(400, f"tool call arguments are not JSON: {c.function.arguments[:80]!r}",
                                   f"messages[{i}].tool_calls", "invalid_value") from None
                except LimitError as e:
                    raise APIError(400, f"tool call arguments: {e.message}", f"messages[{i}].tool_calls",
                                   "invalid_value") from None
                calls.append(syntax.call_text(c.function.name, args))
            out.append({"role": "assistant", "content": "\n".join(filter(None, [text] + calls))})
        else:  # tool (or the legacy function role)
            name = m.name if m.role == "function" else names.get(m.tool_call_id or "")
            if name is None:
                raise APIError(400, f"tool message {i} answers tool_call_id {m.tool_call_id!r}, which no earlier "
                               "assistant message made", f"messages[{i}].tool_call_id", "invalid_value")
            out.append(syntax.tool_message(name, text))
    return out


def max_new(req, context: int, n_prompt: int, default: int = DEFAULT_MAX_TOKENS) -> int:
    """The reply budget: the request's, else `default` capped to the context left."""
    asked = getattr(req, "max_completion_tokens", None) or req.max_tokens
    room = context - n_prompt
    if room < 1 or (asked is not None and asked > room):
        raise APIError(400, f"this model's context is {context} tokens; the prompt has {n_prompt} and "
                       f"{asked or 1} more were requested: shorten the messages or lower max_tokens",
                       "messages", "context_length_exceeded")
    return asked or min(default, room)


DEFAULT_CONTEXT = 8192  # a model whose config names no max_position_embeddings


def context_length(rt) -> int:
    args = getattr(rt.model, "args", None)
    return int(getattr(args, "max_position_embeddings", None) or DEFAULT_CONTEXT)


def chat_prompt(rt, req: ChatRequest):
    """(prompt token ids, tools for the reply, syntax, constraint or None) for a chat request."""
    syntax = detect(rt.tokenizer)
    tools = req.tools or []
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if not isinstance(choice, str):
        choice = {"name": choice.function.name}
        if not any(t.name == choice["name"] for t in tools):
            raise APIError(400, f"tool_choice names {choice['name']!r}, which is not in tools", "tool_choice",
                           "invalid_value")
    if choice in ("required",) and not tools:
        raise APIError(400, "tool_choice 'required' needs at least one tool", "tool_choice", "invalid_value")
    if len({t.name for t in tools}) != len(tools):
        raise APIError(400, "two tools share a name", "tools", "invalid_value")
    messages = chat_messages(req, syntax)
    shown = tools  # tools stay in the prompt under "none" too, so the next turn reuses the same prefix
    if shown or syntax.native:
        text = syntax.render(rt.tokenizer, messages, shown, FINISH_TEXT)
        ids = list(rt.tokenizer.encode(text, add_special_tokens=False))
    else:
        ids = rt.encode(messages)
    grammar = None
    if shown and choice == "none":
        grammar = answer_grammar(syntax)
    elif shown:
        try:
            grammar = lark_grammar(shown, syntax, choice, MAX_STRING)
        except RecursionError:  # limits.py bounds schema depth; this keeps any deeper recursion a 400
            raise APIError(400, "a tool's parameters are nested too deep for JustFit's grammar compiler", "tools",
                           "invalid_schema") from None
        why = check_grammar(grammar)
        if why:
            raise APIError(400, f"a tool's parameters are not a JSON schema JustFit can enforce: {why}", "tools",
                           "invalid_schema")
    elif req.response_format is not None and req.response_format.type != "text":
        grammar = response_grammar(req)
    return ids, shown, syntax, grammar


def response_grammar(req: ChatRequest) -> str:
    fmt = req.response_format
    if fmt.type == "json_object":
        return json_grammar()
    spec = fmt.json_schema
    if spec is None or spec.schema_ is None:
        raise APIError(400, "response_format json_schema needs json_schema.schema", "response_format.json_schema",
                       "invalid_value")
    try:
        grammar = json_grammar(spec.schema_, bool(spec.strict))
    except RecursionError:
        raise APIError(400, "response_format json_schema is nested too deep for JustFit's grammar compiler",
                       "response_format.json_schema.schema", "invalid_schema") from None
    why = check_grammar(grammar)
    if why:
        raise APIError(400, f"response_format json_schema is not a schema JustFit can enforce: {why}",
                       "response_format.json_schema.schema", "invalid_schema")
    return grammar


def completion_prompt(rt, req: CompletionRequest) -> List[int]:
    """Raw prompt ids (no chat template) for /v1/completions."""
    p = req.prompt
    if isinstance(p, list) and p and all(isinstance(x, int) for x in p):
        n = vocab_size(rt.model)
        if any(not 0 <= x < n for x in p):
            raise APIError(400, f"prompt token ids must be in [0, {n})", "prompt", "invalid_value")
        return list(p)
    if isinstance(p, list):
        if len(p) != 1:
            raise APIError(400, "a list of prompts is not supported; send one prompt per request", "prompt",
                           "invalid_value")
        p = p[0]
    if not p:
        raise APIError(400, "prompt is empty", "prompt", "invalid_value")
    return list(rt.tokenizer.encode(p))


def stops(stop) -> List[str]:
    """The stop strings as a list (at most 4, none empty, as OpenAI requires)."""
    s = [stop] if isinstance(stop, str) else list(stop or [])
    if len(s) > 4 or any(not x for x in s):
        raise APIError(400, "stop takes up to 4 non-empty strings", "stop", "invalid_value")
    return s


def check_logit_bias(bias, n_vocab: int) -> dict:
    out = {}
    for k, v in (bias or {}).items():
        if not k.lstrip("-").isdigit() or not 0 <= int(k) < n_vocab:
            raise APIError(400, f"logit_bias key {k!r} is not a token id in [0, {n_vocab})", "logit_bias", "invalid_value")
        if not -100 <= v <= 100:
            raise APIError(400, f"logit_bias value for {k} must be in [-100, 100]", "logit_bias", "invalid_value")
        out[int(k)] = float(v)
    return out

