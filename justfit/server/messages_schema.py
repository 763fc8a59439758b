"""Anthropic's Messages API as pydantic models: the request fields `POST /v1/messages` and
`/v1/messages/count_tokens` read (API.md, "Messages"), and the message object they answer.

Unknown fields are ignored, as on the OpenAI routes; limits.py's limits (nesting, numbers, surrogates,
schema size) apply to the whole body. Content blocks are kept loose here (one model with every block's
fields) so that messages.py can name the block it refuses instead of pydantic listing every union member.
"""

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .limits import MAX_TOOLS, check_schema, check_value


class _In(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class Block(_In):
    """One content block of any type: text, tool_use, tool_result (others are refused by messages.py)."""

    type: str
    text: Optional[str] = None
    id: Optional[str] = None
    name: Optional[str] = None
    input: Optional[Any] = None
    tool_use_id: Optional[str] = None
    content: Union[str, List[Dict[str, Any]], None] = None
    is_error: Optional[bool] = None
    cache_control: Optional[Dict[str, Any]] = None


class InMessage(_In):
    role: Literal["user", "assistant", "system"]  # system: an instruction mid-conversation (Claude Code sends one)
    content: Union[str, List[Block]]


class InTool(_In):
    """A tool: a custom one (no type, or "custom") with an input_schema, or one of Anthropic's typed tools."""

    type: Optional[str] = None
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str = ""
    input_schema: Optional[Dict[str, Any]] = None
    cache_control: Optional[Dict[str, Any]] = None

    @field_validator("input_schema")
    @classmethod
    def _schema_limits(cls, v):
        return check_schema(v)


class InToolChoice(_In):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class CountRequest(_In):
    """What both routes read: the prompt (model, system, messages, tools, tool_choice)."""

    model: str
    messages: List[InMessage] = Field(min_length=1)
    system: Union[str, List[Block], None] = None
    tools: Optional[List[InTool]] = Field(None, max_length=MAX_TOOLS)
    tool_choice: Optional[InToolChoice] = None
    thinking: Optional[Dict[str, Any]] = None  # accepted; this model does not think aloud

    @model_validator(mode="before")
    @classmethod
    def _within_limits(cls, data):
        check_value(data)
        return data


class MessagesRequest(CountRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: Optional[List[str]] = None
    temperature: Optional[float] = Field(None, ge=0.0, le=1.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=0)
    stream: bool = False
    metadata: Optional[Dict[str, Any]] = None
    service_tier: Optional[str] = None
    context_management: Optional[Dict[str, Any]] = None


# -- the answer ----------------------------------------------------------------------------------
class OutUsage(BaseModel):
    """Anthropic's count: input_tokens excludes the cached part, so input + cache_read + cache_creation
    is the whole prompt."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class OutMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: List[Dict[str, Any]]
    stop_reason: Optional[str] = None
    stop_sequence: Optional[str] = None
    usage: OutUsage
