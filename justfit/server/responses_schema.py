"""The OpenAI Responses API request (`POST /v1/responses`) as pydantic models (see API.md, "Responses").

Only the shape is checked here: field types and ranges, and limits.py's limits over the whole body.
What the fields mean for the engine (items -> chat messages, tools -> grammar) is responses_input.py's.
Unknown fields are ignored, as in chat: agents send many.
"""

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from .limits import MAX_TOOLS, check_schema, check_value
from .schema import JSONSchemaSpec, _In


class Part(_In):
    """A content part of an input message (input_text, output_text, ...) or of a tool's output."""

    type: str
    text: Optional[str] = None


class InputItem(_In):
    """One `input` item. `type` is absent or "message" for messages (role + content), "function_call"
    (call_id, name, arguments), "function_call_output" (call_id, output), "reasoning" (dropped), ..."""

    type: Optional[str] = None
    role: Optional[Literal["user", "assistant", "system", "developer"]] = None
    content: Union[str, List[Part], None] = None
    call_id: Optional[str] = None
    name: Optional[str] = None
    arguments: Optional[str] = None
    output: Union[str, List[Part], None] = None


class FunctionTool(_In):
    """A function tool in the Responses shape: flat, not nested under `function` as in chat."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None

    @field_validator("parameters")
    @classmethod
    def _schema_limits(cls, v):
        return check_schema(v)


class TextFormat(JSONSchemaSpec):
    """`text.format`: chat's json_schema spec (name, description, schema, strict) flattened beside its type."""

    type: Literal["text", "json_object", "json_schema"]


class TextConfig(_In):
    format: Optional[TextFormat] = None
    verbosity: Optional[str] = None


class ResponsesRequest(_In):
    model: str
    input: Union[str, List[InputItem], None] = None
    instructions: Optional[str] = None
    tools: Optional[List[Dict[str, Any]]] = Field(None, max_length=MAX_TOOLS)
    tool_choice: Union[Literal["auto", "none", "required"], Dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextConfig] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    store: Optional[bool] = None
    previous_response_id: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[Literal["in-memory", "in_memory", "24h"]] = None
    background: Optional[bool] = None
    conversation: Optional[Any] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    reasoning: Optional[Dict[str, Any]] = None
    include: Optional[List[str]] = None
    metadata: Optional[Dict[str, str]] = None
    user: Optional[str] = None
    service_tier: Optional[str] = None

    @model_validator(mode="before")
    @classmethod
    def _within_limits(cls, data):
        """The whole body, extra fields included, within limits.py's nesting, number and text limits."""
        check_value(data)
        return data
