"""The HTTP API as pydantic models: what `justfit serve` accepts and returns (see API.md).

Requests list every OpenAI field JustFit reads; unknown fields are ignored (as many clients send
extras). Bounds mirror OpenAI's, so a bad value is a 400 naming the field before any work is done;
limits.py's limits (nesting, number size, surrogates, schema size) are checked here too.
"""

import time
from typing import Any, ClassVar, Dict, List, Literal, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from .limits import MAX_STOP, MAX_TOOLS, LimitError, check_schema, check_value

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class _In(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


# -- chat request ---------------------------------------------------------------------------------
class ContentPart(_In):
    type: str
    text: Optional[str] = None


class FunctionCall(_In):
    name: str
    arguments: str = "{}"


class ToolCall(_In):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_In):
    role: Role
    content: Union[str, List[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[List[ToolCall]] = None
    tool_call_id: Optional[str] = None


class FunctionDef(_In):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str = ""
    parameters: Dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: Optional[bool] = None

    @field_validator("parameters")
    @classmethod
    def _schema_limits(cls, v):
        return check_schema(v)


class Tool(_In):
    type: Literal["function"] = "function"
    function: FunctionDef

    @property
    def name(self) -> str:
        return self.function.name

    @property
    def parameters(self) -> dict:
        return self.function.parameters

    def schema(self) -> dict:
        """The OpenAI function schema (what chat templates and the tool prompt show the model)."""
        f = self.function
        return {"type": "function", "function": {"name": f.name, "description": f.description, "parameters": f.parameters}}


class NamedFunction(_In):
    name: str


class NamedToolChoice(_In):
    type: Literal["function"] = "function"
    function: NamedFunction


class JSONSchemaSpec(_In):
    name: str = Field("response", pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Optional[str] = None
    schema_: Optional[Dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None

    @field_validator("schema_")
    @classmethod
    def _schema_limits(cls, v):
        return check_schema(v)


class ResponseFormat(_In):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaSpec] = None


class StreamOptions(_In):
    include_usage: bool = False


class Sampling(_In):
    """Fields shared by chat and text completions."""

    model: str
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: Optional[int] = None
    stop: Union[str, List[str], None] = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: Optional[Dict[str, float]] = None
    n: int = Field(1, ge=1, le=8)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[Literal["in-memory", "in_memory", "24h"]] = None

    @model_validator(mode="before")
    @classmethod
    def _within_limits(cls, data):
        """The whole body, extra fields included, within limits.py's nesting, number and text limits."""
        check_value(data)
        return data

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        """Up to MAX_STOP non-empty strings, checked before the prompt is tokenized."""
        if isinstance(v, list) and (len(v) > MAX_STOP or not all(v)) or v == "":
            raise LimitError(f"takes up to {MAX_STOP} non-empty strings")
        return v


class ChatRequest(Sampling):
    messages: List[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    tools: Optional[List[Tool]] = Field(None, max_length=MAX_TOOLS)
    tool_choice: Union[Literal["auto", "none", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[ResponseFormat] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    top_k: Optional[int] = Field(None, ge=0)  # not OpenAI's: the fronts whose APIs have it (Messages) set it


class CompletionRequest(Sampling):
    prompt: Union[str, List[str], List[int]]
    echo: bool = False
    suffix: Optional[str] = None
    logprobs: Optional[int] = Field(None, ge=0, le=5)
    best_of: Optional[int] = Field(None, ge=1, le=1)


# -- responses -----------------------------------------------------------------------------------
class _Out(BaseModel):
    """A response object that leaves out the optional fields named in OMIT when they are None (the
    OpenAPI spec has them optional but not nullable)."""

    OMIT: ClassVar[Tuple[str, ...]] = ("usage", "system_fingerprint", "tool_calls", "id", "type", "role", "content")

    @model_serializer(mode="wrap")
    def _drop(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None or k not in self.OMIT}


class PromptDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptDetails = Field(default_factory=PromptDetails)


class OutMessage(_Out):
    OMIT: ClassVar[Tuple[str, ...]] = ("tool_calls",)
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    refusal: Optional[str] = None
    tool_calls: Optional[List[ToolCall]] = None


class Choice(BaseModel):
    index: int
    message: OutMessage
    finish_reason: str
    logprobs: Optional[dict] = None


class ChatCompletion(_Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: List[Choice]
    usage: Usage
    system_fingerprint: Optional[str] = None


class ToolCallDelta(_Out):
    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Dict[str, str]


class Delta(_Out):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    tool_calls: Optional[List[ToolCallDelta]] = None


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    finish_reason: Optional[str] = None
    logprobs: Optional[dict] = None


class ChatCompletionChunk(_Out):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: List[ChunkChoice]
    usage: Optional[Usage] = None
    system_fingerprint: Optional[str] = None


class TextChoice(BaseModel):
    index: int
    text: str
    finish_reason: Optional[str]
    logprobs: Optional[dict] = None


class Completion(_Out):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: List[TextChoice]
    usage: Optional[Usage] = None
    system_fingerprint: Optional[str] = None


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "justfit"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: List[Model]
