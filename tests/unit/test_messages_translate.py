"""The Messages front's translation, without a model: Anthropic requests become the chat requests the
one engine path serves (system blocks, tool_use / tool_result, a mid-conversation system message, typed
tools, tool_choice), schemas lose only the keywords the grammar compiler lacks, and errors under
/v1/messages take Anthropic's envelope while the other paths keep OpenAI's."""

import pytest

from justfit.server.errors import APIError, anthropic_envelope, envelope, envelope_for
from justfit.server.messages import enforceable, to_chat
from justfit.server.messages_schema import MessagesRequest

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def request(**kw):
    body = {"model": "claude-sonnet-4-5", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    return MessagesRequest(**{**body, **kw})


def test_tool_round_trip_becomes_chat_tool_messages():
    chat = to_chat(request(
        system=[{"type": "text", "text": "x-anthropic-billing-header: cc_version=1.2.3.abc;"},
                {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        tools=[{"name": "get_weather", "description": "Weather.", "input_schema": SCHEMA},
               {"type": "web_search_20250305", "name": "web_search"}],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        top_k=5, stop_sequences=["END"],
        messages=[{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                                    {"type": "text", "text": "Checking."},
                                                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                     "input": {"city": "Paris"}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                                "content": [{"type": "text", "text": "timeout"}]},
                                               {"type": "text", "text": "Try again."}]},
                  {"role": "system", "content": "Answer in French."}]))
    roles = [(m.role, m.content) for m in chat.messages]
    assert roles == [("system", "Be brief."), ("user", "Weather in Paris?"), ("assistant", "Checking."),
                     ("tool", "Error: timeout"), ("user", "Try again."), ("system", "Answer in French.")]
    call = chat.messages[2].tool_calls[0]
    assert (call.id, call.function.name, call.function.arguments) == ("toolu_1", "get_weather", '{"city": "Paris"}')
    assert chat.messages[3].tool_call_id == "toolu_1"
    assert [t.name for t in chat.tools] == ["get_weather"]  # the server-run web_search is left out
    assert chat.tool_choice.function.name == "get_weather"
    assert (chat.max_tokens, chat.top_k, chat.stop, chat.temperature, chat.top_p) == (8, 5, ["END"], 1.0, 1.0)


@pytest.mark.parametrize("kw,where", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                  "content": [{"type": "document"}]}]}]},
     "messages[0].content[0].content[0].type"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
])
def test_what_a_text_model_cannot_take_is_a_400_naming_it(kw, where):
    with pytest.raises(APIError) as e:
        to_chat(request(**kw))
    assert e.value.status == 400 and e.value.param == where, e.value.message


def test_tool_choice_types():
    tools = [{"name": "f", "input_schema": SCHEMA}]
    assert [to_chat(request(tools=tools, tool_choice={"type": t})).tool_choice for t in ("auto", "any", "none")] == \
        ["auto", "required", "none"]


def test_enforceable_drops_only_unimplemented_keywords():
    schema = {"type": "object", "properties": {
        "propertyNames": {"type": "string"},  # a property that happens to have a keyword's name stays
        "env": {"type": "object", "propertyNames": {"pattern": "^[A-Z]+$"}, "additionalProperties": {"type": "string"}}}}
    out = enforceable(schema)
    assert out["properties"]["propertyNames"] == {"type": "string"}
    assert out["properties"]["env"] == {"type": "object", "additionalProperties": {"type": "string"}}
    assert enforceable(SCHEMA) is SCHEMA


def test_envelope_by_path():
    assert envelope_for("/v1/messages") is anthropic_envelope
    assert envelope_for("/v1/messages/count_tokens") is anthropic_envelope
    assert envelope_for("/v1/chat/completions") is envelope
    assert anthropic_envelope(413, "too big") == {"type": "error", "error": {"type": "request_too_large",
                                                                             "message": "too big"}}
    assert anthropic_envelope(503, "busy")["error"]["type"] == "overloaded_error"
