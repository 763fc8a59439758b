"""The server's app on the default model, in process, driven by the official `openai` SDK: chat
(stream and not), text completions, tools with tool_choice required / named, json_schema output,
cached tokens on a second turn, models.list; every response checked against OpenAI's OpenAPI spec."""

import json

import jsonschema
import pytest

from tests.server_support import InProcess, openapi_validator

openai = pytest.importorskip("openai")

SYSTEM = ("You are a terse assistant for a weather service. " + " ".join(
    f"Rule {i}: answer in one short sentence and never invent a city that was not named." for i in range(40)))
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def server(serve_runtime):
    s = InProcess(serve_runtime)
    yield s
    s.stop()
    assert "sessions checkpointed" in s.text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120,
                         http_client=server.http)


def check(schema: str, obj):
    """Validate a response (an SDK object or a dict) against the OpenAI spec component."""
    data = obj if isinstance(obj, dict) else json.loads(obj.model_dump_json(exclude_unset=True))
    errors = sorted(openapi_validator(schema).iter_errors(data), key=str)
    assert not errors, f"{schema}: {errors[0].message} at {list(errors[0].absolute_path)}"


def test_models_list_and_health(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]
    check("ListModelsResponse", server.http.get("/v1/models").json())
    check("Model", server.http.get("/v1/models/SmolLM2-135M-Instruct").json())
    assert server.http.get("/health").json()["status"] == "ok"


def test_chat_non_stream_with_usage(client, server):
    raw = server.http.post("/v1/chat/completions", json={
        "model": "default", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 6, "temperature": 0})
    check("CreateChatCompletionResponse", raw.json())
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=6, temperature=0,
                                       messages=[{"role": "developer", "content": "Be brief."},
                                                 {"role": "user", "content": [{"type": "text", "text": "Say hello."}]}])
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content and c.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 6 and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert 0 <= r.usage.prompt_tokens_details.cached_tokens < r.usage.prompt_tokens  # token-exact reuse of a shared head


def test_chat_stream_role_deltas_finish_usage(client, server):
    chunks = list(client.chat.completions.create(
        model="default", max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Count: one, two,"}]))
    for c in chunks:
        check("CreateChatCompletionStreamResponse", c)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text and finishes in (["stop"], ["length"])
    assert chunks[-1].choices == [] and 1 <= chunks[-1].usage.completion_tokens <= 6
    # the same request, not streamed, gives the same text (greedy)
    r = client.chat.completions.create(model="default", max_tokens=6, temperature=0,
                                       messages=[{"role": "user", "content": "Count: one, two,"}])
    assert r.choices[0].message.content == text


def _tool_round_trip(client, tool_choice, stream: bool):
    messages = [{"role": "system", "content": "Use the tools."},
                {"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    kw = dict(model="default", messages=messages, tools=[WEATHER, TIME], tool_choice=tool_choice, temperature=0,
              max_tokens=80)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        for c in chunks:
            check("CreateChatCompletionStreamResponse", c)
        deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
        assert deltas[0].id and deltas[0].function.name and len(deltas) >= 2  # id+name first, then fragments
        name, args, call_id = deltas[0].function.name, "".join(d.function.arguments or "" for d in deltas), deltas[0].id
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    else:
        r = client.chat.completions.create(**kw)
        check("CreateChatCompletionResponse", r)
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        call = r.choices[0].message.tool_calls[0]
        name, args, call_id = call.function.name, call.function.arguments, call.id
    schema = {**(WEATHER if name == "get_weather" else TIME)["function"]["parameters"], "additionalProperties": False}
    jsonschema.validate(json.loads(args), schema)
    # the round trip: the tool's result goes back, the model answers in text with tools off
    messages += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}]},
                 {"role": "tool", "tool_call_id": call_id, "content": "18 C and sunny"}]
    r2 = client.chat.completions.create(model="default", messages=messages, tools=[WEATHER, TIME], tool_choice="none",
                                        temperature=0, max_tokens=12)
    assert r2.choices[0].message.content and not r2.choices[0].message.tool_calls
    return name


def test_tool_choice_required_round_trip(client):
    assert _tool_round_trip(client, "required", stream=False) in ("get_weather", "get_time")


def test_tool_choice_named_round_trip_streamed(client):
    assert _tool_round_trip(client, {"type": "function", "function": {"name": "get_time"}}, stream=True) == "get_time"


def test_response_format_json_schema_strict(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                               "temperature_c": {"type": "integer"},
                                               "sky": {"enum": ["sunny", "cloudy", "rainy"]}},
              "required": ["city", "temperature_c", "sky"], "additionalProperties": False}
    r = client.chat.completions.create(
        model="default", temperature=0, max_tokens=60,
        messages=[{"role": "user", "content": "Weather report for Oslo as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "report", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.chat.completions.create(
        model="default", temperature=0, max_tokens=60, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Describe Paris as a JSON object with keys name and country."}])
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)


def test_cached_tokens_on_second_turn(client):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi."}]
    r1 = client.chat.completions.create(model="default", messages=messages, max_tokens=4, temperature=0,
                                        extra_body={"prompt_cache_key": "turns"})
    assert r1.usage.prompt_tokens > 512
    messages += [{"role": "assistant", "content": r1.choices[0].message.content},
                 {"role": "user", "content": "And Paris?"}]
    r2 = client.chat.completions.create(model="default", messages=messages, max_tokens=4, temperature=0,
                                        extra_body={"prompt_cache_key": "turns"})
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert r1.usage.prompt_tokens <= cached < r2.usage.prompt_tokens  # the whole first turn, not the new message


def test_text_completions(client, server):
    r = client.completions.create(model="default", prompt="The capital of France is", max_tokens=4, temperature=0)
    check("CreateCompletionResponse", r)
    assert r.choices[0].text and r.usage.completion_tokens <= 4
    chunks = list(client.completions.create(model="default", prompt="The capital of France is", max_tokens=4,
                                            temperature=0, stream=True))
    for c in chunks:  # OpenAI's spec says finish_reason is a string; its API (and we) send null mid-stream
        d = json.loads(c.model_dump_json(exclude_unset=True))
        d["choices"] = [{**ch, "finish_reason": ch["finish_reason"] or "length"} for ch in d["choices"]]
        check("CreateCompletionResponse", d)
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_metrics_are_prometheus_text(server, client):
    text = server.http.get("/metrics").text
    for name in ("justfit_requests_total", "justfit_prompt_tokens_total", "justfit_cached_tokens_total",
                 "justfit_ttft_seconds_bucket", "justfit_inter_token_seconds_count", "justfit_pool_pages",
                 "justfit_resident_bytes", "justfit_queue_length"):
        assert name in text
    assert 'justfit_requests_total{route="/v1/chat/completions",status="200"}' in text
