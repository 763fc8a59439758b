"""Request values that once made `justfit serve` answer 500 (a lone surrogate, JSON nested 2,000 deep,
a 5,000-digit integer, a tool schema 300 deep) and their neighbours (huge n, NaN, 10k stop strings,
a schema with thousands of properties): each is a 400 in OpenAI's error envelope naming where the bad
value sits, checked first without a model (limits.py, schema.py), then against a real server with
the bytes a hostile client would send."""

import json

import httpx
import pytest
from pydantic import ValidationError

from justfit.server.limits import (MAX_DEPTH, MAX_INT_DIGITS, MAX_SCHEMA_DEPTH, LimitError,
                                   check_value, parse_json)
from justfit.server.schema import ChatRequest, CompletionRequest

from tests.server_support import Served, openapi_validator

MSG = [{"role": "user", "content": "Hi"}]
S = "\ud800"  # a lone surrogate: json.dumps writes it as the escape `\ud800`, which JSON parsers accept


def chat(**over):
    return {"model": "default", "messages": MSG, "max_tokens": 2, **over}


def nested_schema(levels: int) -> dict:
    s = {"type": "string"}
    for _ in range(levels):
        s = {"type": "object", "properties": {"a": s}}
    return s


def tool(parameters=None, description="", name="f") -> dict:
    return {"type": "function", "function": {"name": name, "description": description,
                                             **({"parameters": parameters} if parameters is not None else {})}}


def call(arguments: str) -> list:
    return MSG + [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                        "function": {"name": "f", "arguments": arguments}}]}]


WIDE = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}}
CASES = [  # (what, path, body as JSON text)
    ("surrogate in a message", "/v1/chat/completions", chat(messages=[{"role": "user", "content": S}])),
    ("surrogate in the system prompt", "/v1/chat/completions",
     chat(messages=[{"role": "system", "content": "a" + S}] + MSG)),
    ("surrogate in a tool description", "/v1/chat/completions", chat(tools=[tool(description=S)])),
    ("surrogate in a parameter description", "/v1/chat/completions",
     chat(tools=[tool({"type": "object", "properties": {"a": {"type": "string", "description": S}}})])),
    ("surrogate in a completions prompt", "/v1/completions", {"model": "default", "prompt": S, "max_tokens": 2}),
    ("surrogate in a tool result", "/v1/chat/completions",
     chat(messages=call("{}") + [{"role": "tool", "tool_call_id": "c1", "content": S}])),
    ("surrogate inside tool-call arguments", "/v1/chat/completions", chat(messages=call('{"a": "\\ud800"}'))),
    ("surrogate in a stop string", "/v1/chat/completions", chat(stop=[S])),
    ("arguments nested 2,000 deep", "/v1/chat/completions", chat(messages=call("[" * 2000 + "]" * 2000))),
    ("arguments nested 100 deep", "/v1/chat/completions", chat(messages=call("[" * 100 + "]" * 100))),
    ("a 5,000-digit integer in arguments", "/v1/chat/completions", chat(messages=call('{"a": ' + "9" * 5000 + "}"))),
    ("NaN in arguments", "/v1/chat/completions", chat(messages=call('{"a": NaN}'))),
    ("parameters nested 300 deep, tool_choice required", "/v1/chat/completions",
     chat(tools=[tool(nested_schema(300))], tool_choice="required")),
    ("parameters nested 300 deep, tool_choice auto", "/v1/chat/completions", chat(tools=[tool(nested_schema(300))])),
    ("response_format schema nested 300 deep", "/v1/chat/completions",
     chat(response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": nested_schema(300)}})),
    ("a schema with 5,000 properties", "/v1/chat/completions", chat(tools=[tool(WIDE)], tool_choice="required")),
    ("n = 10**30", "/v1/chat/completions", chat(n=10 ** 30)),
    ("n = 9", "/v1/chat/completions", chat(n=9)),
    ("negative temperature", "/v1/chat/completions", chat(temperature=-1)),
    ("max_tokens = 10**40", "/v1/chat/completions", chat(max_tokens=10 ** 40)),
    ("seed = 10**40", "/v1/chat/completions", chat(seed=10 ** 40)),
    ("10,000 stop strings", "/v1/chat/completions", chat(stop=["a"] * 10_000)),
    ("129 tools", "/v1/chat/completions", chat(tools=[tool(name=f"f{i}") for i in range(129)])),
    ("a token id of 40 digits", "/v1/completions", {"model": "default", "prompt": [10 ** 40]}),
]
RAW = [  # (what, body text): not expressible with json.dumps
    ("NaN temperature", '{"model": "default", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}'),
    ("Infinity top_p", '{"model": "default", "messages": [{"role": "user", "content": "x"}], "top_p": Infinity}'),
    ("NaN logit_bias", '{"model": "default", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"1": NaN}}'),
    ("1e400 penalty", '{"model": "default", "messages": [{"role": "user", "content": "x"}], "presence_penalty": 1e400}'),
    ("a 5,000-digit integer in the body", '{"model": "default", "messages": [], "n": ' + "1" * 5000 + "}"),
    ("an extra field nested 100,000 deep", '{"model": "default", "messages": [{"role": "user", "content": "x"}], '
     '"metadata": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    ("an extra field nested 500 deep", '{"model": "default", "messages": [{"role": "user", "content": "x"}], '
     '"metadata": ' + "[" * 500 + "]" * 500 + "}"),
]


# -- without a model ------------------------------------------------------------------------------
@pytest.mark.parametrize("value,where", [
    ({"a": [1, {"b": "x" + S}]}, "a[1].b"),
    ({"k" + S: 1}, ""),
    ({"n": 10 ** MAX_INT_DIGITS}, "n"),
    ({"f": float("nan")}, "f"),
    ({"f": float("-inf")}, "f"),
])
def test_check_value_names_where_the_bad_value_is(value, where):
    with pytest.raises(LimitError) as e:
        check_value(value)
    assert e.value.path == where


def test_check_value_depth_is_exact_and_iterative():
    ok = [] if MAX_DEPTH == 0 else json.loads("[" * MAX_DEPTH + "]" * MAX_DEPTH)
    assert check_value(ok) == MAX_DEPTH
    deep: list = []
    for _ in range(50_000):  # past Python's recursion limit: refused by the limit, not by a crash
        deep = [deep]
    with pytest.raises(LimitError, match="nested deeper"):
        check_value(deep)
    check_value({"n": 10 ** MAX_INT_DIGITS - 1, "s": "héllo ✓ 😀", "f": 1.5, "t": True, "z": None})


@pytest.mark.parametrize("text", ["[" * 2000 + "]" * 2000, "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1),
                                  '{"a": ' + "9" * 5000 + "}", '{"a": NaN}', '{"a": -Infinity}', "[1e400]",
                                  '["\\ud800"]', '{"\\udfff": 1}'])
def test_parse_json_refuses_what_a_body_may_not_hold(text):
    with pytest.raises(LimitError):
        parse_json(text)


def test_parse_json_reads_ordinary_arguments():
    assert parse_json('{"city": "Zürich", "days": [1, 2.5], "n": -12345678901234567890}') == \
        {"city": "Zürich", "days": [1, 2.5], "n": -12345678901234567890}
    with pytest.raises(json.JSONDecodeError):
        parse_json("{not json")


def test_schema_limits_are_checked_by_the_request_model():
    ChatRequest.model_validate(chat(tools=[tool(nested_schema(MAX_SCHEMA_DEPTH // 2 - 1))]))
    for params in (nested_schema(MAX_SCHEMA_DEPTH // 2), WIDE):
        with pytest.raises(ValidationError) as e:
            ChatRequest.model_validate(chat(tools=[tool(params)]))
        assert isinstance(e.value.errors()[0]["ctx"]["error"], LimitError)
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": S})


# -- against a real server ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    s = Served(tmp_path_factory.mktemp("serve-limits"), str(default_model_dir))
    yield s
    s.stop()


def post(server, path: str, text: str) -> httpx.Response:
    return httpx.post(server.url + path, content=text.encode(), headers={"content-type": "application/json"},
                      timeout=120)


def check_400(r: httpx.Response) -> dict:
    assert r.status_code == 400, (r.status_code, r.text[:300])
    body = r.json()
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"], body
    assert not list(openapi_validator("ErrorResponse").iter_errors(body))
    assert "Traceback" not in body["error"]["message"] and "internal error" not in body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize("what,path,body", CASES, ids=[c[0] for c in CASES])
def test_hostile_values_are_400s(server, what, path, body):
    text = json.dumps(body)
    assert "\\ud800" in text or S not in str(body)  # the surrogate travels as a JSON escape
    check_400(post(server, path, text))


@pytest.mark.parametrize("what,text", RAW, ids=[c[0] for c in RAW])
def test_hostile_raw_bodies_are_400s(server, what, text):
    check_400(post(server, "/v1/chat/completions", text))


def test_error_names_the_field(server):
    err = check_400(post(server, "/v1/chat/completions", json.dumps(chat(messages=MSG + [{"role": "user", "content": S}]))))
    assert err["param"] == "messages[1].content" and "surrogate" in err["message"]
    err = check_400(post(server, "/v1/chat/completions", json.dumps(chat(messages=call("[" * 2000 + "]" * 2000)))))
    assert err["param"] == "messages[1].tool_calls" and "nested" in err["message"]


def test_values_at_the_limits_are_served(server):
    ok = [chat(messages=call("[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1))),
          chat(messages=[{"role": "user", "content": "héllo ✓ 😀"}], seed=10 ** MAX_INT_DIGITS - 1),
          chat(tools=[tool(nested_schema(4))], tool_choice="required", max_tokens=1)]
    for body in ok:
        r = post(server, "/v1/chat/completions", json.dumps(body))
        assert r.status_code in (200, 400), r.text[:300]  # the seed is the engine's to judge; never a 500
    assert "internal error" not in server.text()
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
