"""`POST /v1/responses` on the default model, in process, driven by the official `openai` SDK: text (stream
and not, every event and response checked against OpenAI's OpenAPI spec), max_output_tokens -> incomplete,
a function call answered with function_call_output (stateless and through previous_response_id),
json_schema output, stored responses (GET, DELETE, the follow-up's cached tokens), ignored tool types,
and the 4xx answers for malformed requests. The restart test runs `justfit serve` twice over one home."""

import json

import httpx
import jsonschema
import pytest

from tests.server_support import Served, openapi_validator

openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather for a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                          "required": ["city", "unit"]}}
LONG = "You are a terse assistant for a weather service. " + " ".join(
    f"Rule {i}: answer in one short sentence and never invent a city that was not named." for i in range(30))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120,
                         http_client=server.http)


def check(schema: str, data: dict):
    errors = sorted(openapi_validator(schema).iter_errors(data), key=str)
    assert not errors, f"{schema}: {errors[0].message} at {list(errors[0].absolute_path)}"


EVENTS = {"response.created": "ResponseCreatedEvent", "response.in_progress": "ResponseInProgressEvent",
          "response.output_item.added": "ResponseOutputItemAddedEvent",
          "response.content_part.added": "ResponseContentPartAddedEvent",
          "response.output_text.delta": "ResponseTextDeltaEvent", "response.output_text.done": "ResponseTextDoneEvent",
          "response.content_part.done": "ResponseContentPartDoneEvent",
          "response.function_call_arguments.delta": "ResponseFunctionCallArgumentsDeltaEvent",
          "response.function_call_arguments.done": "ResponseFunctionCallArgumentsDoneEvent",
          "response.output_item.done": "ResponseOutputItemDoneEvent", "response.completed": "ResponseCompletedEvent",
          "response.incomplete": "ResponseIncompleteEvent", "response.failed": "ResponseFailedEvent"}


def sse_events(text: str) -> list:
    """The (event name, data) pairs of a text/event-stream body."""
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_text_response_matches_spec_and_sdk(client, server):
    raw = server.http.post("/v1/responses", json={"model": "default", "input": "Say hello.", "max_output_tokens": 6,
                                                  "temperature": 0, "store": False})
    assert raw.status_code == 200, raw.text
    check("Response", raw.json())
    r = client.responses.create(model="default", instructions="Be brief.", temperature=0, max_output_tokens=6,
                                input=[{"role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}])
    assert r.id.startswith("resp_") and r.object == "response" and r.output_text
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens <= 6
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0


def test_stream_events_in_order(client, server):
    body = {"model": "default", "input": "Count: one, two,", "max_output_tokens": 6, "temperature": 0,
            "stream": True, "store": False}
    raw = server.http.post("/v1/responses", json=body)
    events = sse_events(raw.text)
    for name, data in events:
        assert name == data["type"]
        check(EVENTS[name], data)
    names = [n for n, _ in events]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert names[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # six tokens of counting never reach the end of turn
    deltas = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    assert deltas == events[-4][1]["text"] and events[-1][1]["response"]["incomplete_details"] == {
        "reason": "max_output_tokens"}
    # the SDK reads the same stream; the same request not streamed gives the same text (greedy)
    seen = [ev.type for ev in client.responses.create(**{k: v for k, v in body.items() if k != "model"},
                                                      model="default")]
    assert seen == names
    r = client.responses.create(model="default", input="Count: one, two,", max_output_tokens=6, temperature=0)
    assert r.output_text == deltas and r.status == "incomplete"


def test_function_call_then_output(client, server):
    first = client.responses.create(model="default", input="What is the weather in Paris, in celsius?",
                                    tools=[WEATHER], tool_choice="required", temperature=0, max_output_tokens=60,
                                    store=False)
    call = first.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), {**WEATHER["parameters"], "additionalProperties": False})
    # stateless: the whole conversation comes back with the call and its output
    items = [{"role": "user", "content": "What is the weather in Paris, in celsius?"},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"}]
    second = client.responses.create(model="default", input=items, tools=[WEATHER], tool_choice="none",
                                     temperature=0, max_output_tokens=10, store=False)
    assert second.output[0].type == "message" and second.output_text.strip()
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16  # the shared head


def test_streamed_call_continued_by_previous_response_id(client, server):
    events = list(client.responses.create(model="default", input="Weather in Oslo, in celsius?", tools=[WEATHER],
                                          tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                          max_output_tokens=60, stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == done.arguments
    first = events[-1].response
    call = first.output[0]
    second = client.responses.create(model="default", previous_response_id=first.id, tools=[WEATHER],
                                     tool_choice="none", temperature=0, max_output_tokens=8,
                                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "-3 C"}])
    assert second.previous_response_id == first.id and second.output[0].type == "message"
    # the follow-up ran on the conversation's session: the first turn's prompt and call were not prefilled again
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


def test_json_schema_output_parses(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                               "temperature_c": {"type": "integer"},
                                               "sky": {"enum": ["sunny", "cloudy", "rainy"]}},
              "required": ["city", "temperature_c", "sky"], "additionalProperties": False}
    r = client.responses.create(model="default", input="Weather report for Oslo as JSON.", temperature=0,
                                max_output_tokens=60, store=False,
                                text={"format": {"type": "json_schema", "name": "report", "schema": schema,
                                                 "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_store_get_delete_and_follow_up(client, server):
    first = client.responses.create(model="default", instructions=LONG, input="Hi.", max_output_tokens=4,
                                    temperature=0)
    assert first.store is True and first.usage.input_tokens > 300
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    check("Response", server.http.get(f"/v1/responses/{first.id}").json())
    second = client.responses.create(model="default", instructions=LONG, input="And Paris?",
                                     previous_response_id=first.id, max_output_tokens=4, temperature=0)
    cached = second.usage.input_tokens_details.cached_tokens
    assert first.usage.input_tokens <= cached < second.usage.input_tokens  # only the new input was prefilled
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="default", input="x", previous_response_id=first.id)
    assert e.value.body["code"] == "previous_response_not_found"
    assert server.http.get("/v1/responses/..%2F..%2Fetc").status_code == 404


def test_other_tool_types_are_ignored(client):
    tools = [{"type": "web_search"}, {"type": "custom", "name": "apply_patch", "format": {"type": "text"}},
             {"type": "namespace", "name": "agents", "tools": []}, {"type": "local_shell"}, WEATHER]
    r = client.responses.create(model="default", input="Weather in Rome, in celsius?", tools=tools,
                                tool_choice="required", temperature=0, max_output_tokens=60, store=False)
    assert r.output[0].type == "function_call" and r.output[0].name == "get_weather"
    assert [t.type for t in r.tools][:2] == ["web_search", "custom"]  # echoed as sent


@pytest.mark.parametrize("body, param, code", [
    ({"input": "x"}, "model", "invalid_value"),
    ({"model": "default"}, "input", "invalid_value"),
    ({"model": "default", "input": [{"type": "mystery"}]}, "input[0].type", "unsupported_value"),
    ({"model": "default", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type", "unsupported_content"),
    ({"model": "default", "input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}]},
     "input[0].call_id", "invalid_value"),
    ({"model": "default", "input": "x", "tools": [{"type": "function", "name": "bad name!"}]}, "tools[0]",
     "invalid_value"),
    ({"model": "default", "input": "x", "tool_choice": {"type": "web_search"}}, "tool_choice", "unsupported_value"),
    ({"model": "default", "input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}},
     "tool_choice", "invalid_value"),
    ({"model": "default", "input": "x", "text": {"format": {"type": "json_schema", "name": "r"}}},
     "text.format.schema", "invalid_value"),
    ({"model": "default", "input": "x", "background": True}, "background", "unsupported_parameter"),
    ({"model": "default", "input": "x", "max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
    ({"model": "default", "input": "x", "previous_response_id": "resp_unknown"}, "previous_response_id",
     "previous_response_not_found"),
    ({"model": "default", "input": "word " * 9000}, "input", "context_length_exceeded"),
    ({"model": "nope", "input": "x"}, "model", "model_not_found"),
])
def test_malformed_requests_are_4xx_in_openai_envelope(server, body, param, code):
    r = server.http.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error") and err["message"]


def test_previous_response_survives_restart(default_model_dir, tmp_path):
    """A stored conversation is on disk with its session: after a restart its follow-up prefills only
    the new input."""
    body = {"model": "default", "instructions": LONG, "input": "Hi.", "max_output_tokens": 4, "temperature": 0}
    s = Served(tmp_path, str(default_model_dir))
    try:
        first = httpx.post(s.url + "/v1/responses", json=body, timeout=120).json()
    finally:
        assert s.stop() in (0, -15, 143) and "sessions checkpointed" in s.text(), s.text()
    s = Served(tmp_path, str(default_model_dir))
    try:
        assert httpx.get(f"{s.url}/v1/responses/{first['id']}", timeout=30).json()["id"] == first["id"]
        second = httpx.post(s.url + "/v1/responses", timeout=120, json={
            **body, "input": "And Paris?", "previous_response_id": first["id"]}).json()
    finally:
        s.stop()
    assert second["usage"]["input_tokens_details"]["cached_tokens"] >= first["usage"]["input_tokens"], s.text()
