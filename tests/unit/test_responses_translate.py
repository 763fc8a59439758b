"""Responses requests -> chat requests (responses_input.py) and reply parts -> Responses events
(responses_output.py, the SSE writer), without a model."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from justfit.server.errors import APIError
from justfit.server.responses import _skeleton, _sse
from justfit.server.responses_input import chat_request
from justfit.server.responses_output import Output
from justfit.server.responses_schema import ResponsesRequest
from tests.server_support import openapi_validator

WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}


def translate(history=(), **body):
    req = ResponsesRequest.model_validate({"model": "default", **body})
    return chat_request(req, list(history), None, None)


def test_items_become_chat_messages():
    chat, new = translate(instructions="Be brief.", input=[
        {"type": "reasoning", "summary": []},
        {"role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
        {"type": "message", "role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "18 C"}]}])
    roles = [(m.role, m.content if isinstance(m.content, str) else None) for m in chat.messages]
    assert roles == [("system", "Be brief."), ("developer", "Rules."), ("user", "Weather?"), ("assistant", "Checking."),
                     ("tool", "18 C")]
    assert chat.messages[3].tool_calls[0].id == "c1"  # the call joined the assistant message before it
    assert new[0] == {"role": "developer", "content": "Rules."}  # instructions are not part of the conversation


def test_history_comes_first_and_answers_its_calls():
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c9", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}]
    chat, new = translate(history, input=[{"type": "function_call_output", "call_id": "c9", "output": "sunny"}])
    assert [m.role for m in chat.messages] == ["user", "assistant", "tool"] and new[0]["tool_call_id"] == "c9"


def test_tools_choice_and_format():
    chat, _ = translate(input="x", tools=[{"type": "web_search"}, {"type": "custom", "name": "patch"}, WEATHER],
                        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=7,
                        text={"format": {"type": "json_schema", "name": "r", "schema": {"type": "object"},
                                         "strict": True}})
    assert [t.name for t in chat.tools] == ["get_weather"] and chat.tool_choice.function.name == "get_weather"
    assert chat.response_format.json_schema.schema_ == {"type": "object"} and chat.max_completion_tokens == 7
    assert chat.temperature == 1.0 and chat.top_p == 1.0
    chat, _ = translate(input="x", tool_choice="auto")
    assert chat.tools is None and chat.tool_choice is None


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"content": "no role"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]"),
    ({"input": [{"type": "function_call_output", "call_id": "x", "output": "1"}]}, "input[0].call_id"),
    ({"input": []}, "input"),
    ({"input": "x", "tools": [{"type": "function", "name": "a b"}]}, "tools[0]"),
    ({"input": "x", "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
])
def test_refusals_name_the_field(body, param):
    with pytest.raises(APIError) as e:
        translate(**body)
    assert e.value.status == 400 and e.value.param == param


def test_text_events_and_final_response():
    out = Output({"id": "resp_1", "output": []}, "call_1")
    events = out.start() + out.part("content", "Hel") + out.part("content", "lo")
    events += out.done(None, {"finish_reason": "stop", "generated_tokens": 2, "reused_tokens": 3}, 10)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"].split(".", 1)[1] for e in events] == [
        "created", "in_progress", "output_item.added", "content_part.added", "output_text.delta",
        "output_text.delta", "output_text.done", "content_part.done", "output_item.done", "completed"]
    r = out.response
    assert r["status"] == "completed" and r["output"][0]["content"][0]["text"] == "Hello"
    assert r["usage"] == {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 3}, "output_tokens": 2,
                          "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 12}
    assert out.assistant_message() == {"role": "assistant", "content": "Hello"}


def test_call_events_and_incomplete_text():
    out = Output({"id": "resp_1", "output": []}, "call_1")
    events = out.part("call", "get_weather") + out.part("args", '{"city"') + out.part("args", ': "Oslo"}')
    events += out.done({"name": "get_weather", "arguments": '{"city": "Oslo"}'}, {"finish_reason": "stop"}, 5)
    assert [e["type"] for e in events][-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                                                "response.completed"]
    item = out.response["output"][0]
    assert (item["type"], item["call_id"], item["arguments"]) == ("function_call", "call_1", '{"city": "Oslo"}')
    assert out.assistant_message()["tool_calls"][0]["id"] == "call_1"
    cut = Output({"id": "resp_2", "output": []}, "call_2")
    events = cut.part("content", "one two") + cut.done(None, {"finish_reason": "length"}, 5)
    assert events[-1]["type"] == "response.incomplete"
    assert cut.response["incomplete_details"] == {"reason": "max_output_tokens"}


def test_an_error_after_the_start_is_a_failed_event():
    class Job:
        cancelled = type("Flag", (), {"set": lambda self: None})()

    req = ResponsesRequest.model_validate({"model": "default", "input": "x"})
    chat, _ = chat_request(req, [], None, None)
    out = Output(_skeleton(req, SimpleNamespace(model_id="tiny"), "resp_" + "0" * 32, chat, False), "call_1")

    async def events():
        for ev in out.start():
            yield ev
        raise APIError(503, "out of memory budget", code="memory_budget")

    async def collect():
        return [line async for line in _sse(events(), Job(), out)]

    lines = asyncio.run(collect())
    last = json.loads(lines[-1].split("data: ", 1)[1])
    assert lines[-1].startswith("event: response.failed\n") and last["sequence_number"] == 2
    assert last["response"]["status"] == "failed" and last["response"]["error"] == {
        "code": "server_error", "message": "out of memory budget"}
    errors = list(openapi_validator("ResponseFailedEvent").iter_errors(last))
    assert not errors, errors[0].message


def test_a_text_part_without_text_is_empty_text():
    chat, _ = translate(input=[{"role": "user", "content": [{"type": "input_text"}, {"type": "input_text", "text": "hi"}]}])
    assert chat.messages[0].content == "hi"
