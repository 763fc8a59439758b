"""Server pieces without a model: tool-call deltas, response shapes, bind policy, JSON grammars."""

import json

import pytest

from justfit.errors import UserError
from justfit.grammar import check_grammar, json_grammar, lark_grammar
from justfit.server.app import check_bind
from justfit.server.deltas import Reply
from justfit.server.schema import ChatRequest, Delta, OutMessage, Tool
from justfit.toolcalls import SYNTAXES


@pytest.mark.parametrize("syntax", list(SYNTAXES))
def test_tool_call_streams_name_first_then_arguments_that_join_to_the_call(syntax):
    syn = SYNTAXES[syntax]
    args = {"city": "Paris", "unit": "c", "days": [1, 2]}
    text = syn.call_text("get_weather", args)
    for size in (1, 3, 7):
        reply = Reply(syn, tools=True)
        parts = []
        for i in range(0, len(text), size):
            parts += reply.add(text[i:i + size])
        rest, call = reply.finish()
        parts += rest
        assert parts[0] == ("call", "get_weather") and all(k == "args" for k, _ in parts[1:])
        joined = "".join(t for _, t in parts[1:])
        assert json.loads(joined) == args and call == {"name": "get_weather", "arguments": joined}


def test_plain_answer_with_tools_is_content():
    reply = Reply(SYNTAXES["justfit"], tools=True)
    parts = reply.add("  ") + reply.add("Paris is sunny.")
    assert parts == [("content", "  Paris is sunny.")] and reply.finish() == ([], None)


def test_optional_fields_are_left_out_not_null():
    assert Delta(content="x").model_dump() == {"content": "x"}
    assert OutMessage(content=None).model_dump() == {"role": "assistant", "content": None, "refusal": None}


def test_request_model_reads_openai_fields():
    req = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                      "tools": [{"type": "function", "function": {"name": "f"}}],
                                      "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"}}},
                                      "some_future_field": 1})
    assert isinstance(req.tools[0], Tool) and req.tools[0].schema()["function"]["parameters"]["type"] == "object"
    assert req.response_format.json_schema.schema_ == {"type": "object"}


def test_bind_policy():
    check_bind("127.0.0.1", None)
    check_bind("::1", None)
    check_bind("localhost", None)
    check_bind("0.0.0.0", "key")
    for host in ("0.0.0.0", "192.168.1.4", "example.com"):
        with pytest.raises(UserError, match="--api-key"):
            check_bind(host, None)


def test_json_grammars_compile_or_say_why():
    assert check_grammar(json_grammar()) is None
    assert check_grammar(json_grammar({"type": "object", "properties": {"a": {"type": "integer"}}}, strict=True)) is None
    assert "objectx" in check_grammar(json_grammar({"type": "objectx"}))
    tool = Tool.model_validate({"function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}})
    assert check_grammar(lark_grammar([tool], SYNTAXES["justfit"], "required")) is None
