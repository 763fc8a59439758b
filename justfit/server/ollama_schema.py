"""Ollama's API as pydantic models: the request bodies of /api/chat, /api/generate and /api/show
(see API.md, "Ollama"), and their translation into the one engine request, schema.ChatRequest.

Unknown fields are ignored as Ollama does; the bounds of the fields JustFit reads are the chat
request's, so a bad value is a 400 naming the field before any work is done.
"""

from typing import Any, Dict, List, Literal, Optional, Union

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import APIError
from .limits import LimitError, check_schema, check_value, parse_json
from .schema import ChatRequest, Tool


class _In(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Options(_In):
    """`options`: the Modelfile parameters a request may override. Those not listed are ignored."""

    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_k: Optional[int] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    num_predict: Optional[int] = Field(None, ge=-2)
    num_ctx: Optional[int] = Field(None, ge=1)
    stop: Optional[List[str]] = None
    seed: Optional[int] = None
    repeat_penalty: Optional[float] = Field(None, gt=0.0)
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)


class CallFunction(_In):
    name: str
    arguments: Union[Dict[str, Any], str] = Field(default_factory=dict)


class ToolCall(_In):
    function: CallFunction


class Message(_In):
    role: Literal["system", "user", "assistant", "tool"]
    content: Optional[str] = ""
    images: Optional[List[Any]] = None
    tool_calls: Optional[List[ToolCall]] = None
    tool_name: Optional[str] = None
    thinking: Optional[str] = None  # a reasoning model's trace: not shown back to the model


Format = Union[Literal["", "json"], Dict[str, Any], None]
KeepAlive = Union[float, str, None]


class _Generating(_In):
    """Fields shared by /api/chat and /api/generate."""

    model: str
    format: Format = None
    options: Options = Field(default_factory=Options)
    stream: bool = True  # Ollama streams unless told not to
    keep_alive: KeepAlive = None
    think: Union[bool, str, None] = None  # accepted, ignored: the served models have no thinking mode

    @model_validator(mode="before")
    @classmethod
    def _within_limits(cls, data):
        """The whole body within limits.py's nesting, number and text limits; a JSON schema `format`
        within the schema limits. A field sent as null takes its default, as in Ollama."""
        check_value(data)
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if v is not None}
            if isinstance(data.get("format"), dict):
                check_schema(data["format"])
        return data


class ChatBody(_Generating):
    messages: List[Message] = Field(default_factory=list)
    tools: Optional[List[Tool]] = None


class GenerateBody(_Generating):
    prompt: Optional[str] = None
    suffix: Optional[str] = None
    system: Optional[str] = None
    template: Optional[str] = None
    context: Optional[List[int]] = None
    raw: bool = False
    images: Optional[List[Any]] = None


class ShowBody(_In):
    model: Optional[str] = None
    name: Optional[str] = None  # the field's name before Ollama renamed it `model`
    verbose: bool = False


async def read_body(request: Request, model):
    """The body as JSON whatever its content type: Ollama reads it so, and its documentation's
    `curl URL -d '{...}'` sends it form-typed. Problems answer as FastAPI's own validation does."""
    raw = await request.body()
    try:
        data = parse_json(raw.decode("utf-8")) if raw.strip() else {}
    except LimitError as e:
        raise APIError(400, f"the request body is beyond a limit: {e.message}") from None
    except ValueError as e:  # not JSON, not UTF-8, or a number beyond the limits
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


class EngineRequest(ChatRequest):
    """The chat request with the sampling settings Ollama has and OpenAI lacks."""

    repetition_penalty: Optional[float] = Field(None, gt=0.0)


def engine_request(model: str, messages: List[dict], body: _Generating, tools=None) -> EngineRequest:
    """The one engine request for an Ollama body: Ollama's sampling defaults (temperature 0.8, top_k
    40, top_p 0.9) where `options` leaves them out; `format` as the response format."""
    o = body.options
    fields = {"model": model, "messages": messages, "tools": tools or None,
              "temperature": 0.8 if o.temperature is None else o.temperature,
              "top_k": 40 if o.top_k is None else o.top_k, "top_p": o.top_p or 0.9,
              "seed": o.seed if o.seed is not None and o.seed >= 0 else None,  # Ollama: -1 is a random seed
              "stop": o.stop or None, "repetition_penalty": o.repeat_penalty,
              "presence_penalty": o.presence_penalty or 0.0, "frequency_penalty": o.frequency_penalty or 0.0,
              "response_format": response_format(body.format)}
    try:
        return EngineRequest(**fields)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise APIError(400, f"{where}: {first['msg'].removeprefix('Value error, ')}") from None


def response_format(fmt: Format) -> Optional[dict]:
    """`format`: "json" (any JSON value as an object) or a JSON schema (enforced, objects closed)."""
    if not fmt:
        return None
    if fmt == "json":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": "response", "schema": fmt, "strict": True}}
