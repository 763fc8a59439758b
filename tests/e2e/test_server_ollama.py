"""Ollama's API on the default model, in process, driven by the official `ollama` Python client: chat
and generate (streamed and not), tags, show, ps, version, a streamed tool call, format json and a
schema, keep_alive 0 releasing the weights, and errors in Ollama's `{"error": "..."}` shape."""

import json
import time

import httpx
import pytest


ollama = pytest.importorskip("ollama")

NAME = "SmolLM2-135M-Instruct:latest"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
GREEDY = {"temperature": 0, "num_predict": 6}


class AppTransport(httpx.BaseTransport):
    """The in-process app as an httpx transport for the ollama client, which uses the `httpx` package;
    starlette's TestClient speaks `httpx2`, so each request is handed over and the answer streamed back."""

    class Body(httpx.SyncByteStream):
        def __init__(self, response):
            self.response = response

        def __iter__(self):
            yield from self.response.iter_raw()

        def close(self):
            self.response.close()

    def __init__(self, server):
        self.http = server.http

    def handle_request(self, request):
        sent = self.http.build_request(request.method, str(request.url), headers=list(request.headers.raw),
                                       content=request.read())
        response = self.http.send(sent, stream=True)
        return httpx.Response(response.status_code, headers=list(response.headers.raw), stream=self.Body(response))


@pytest.fixture(scope="module")
def client(server):
    """The ollama client over the in-process app (its keyword arguments go to its httpx.Client)."""
    return ollama.Client(host=server.url, transport=AppTransport(server), timeout=120)


def durations_ok(r):
    assert r.done and r.done_reason in ("stop", "length")
    assert r.prompt_eval_count > 5 and 1 <= r.eval_count <= 6
    assert r.total_duration >= r.eval_duration >= 0 and r.prompt_eval_duration >= 0 and r.load_duration >= 0


def test_root_version_tags_show(client, server):
    assert server.http.get("/").text == "Ollama is running"
    assert server.http.head("/").status_code == 200
    assert server.http.get("/api/version").json()["version"].count(".") == 2
    models = client.list().models
    assert [m.model for m in models] == [NAME]
    m = models[0]
    assert m.size > 50_000_000 and len(m.digest) == 64
    assert m.details.family == "llama" and m.details.quantization_level == "Q4"
    assert m.details.parameter_size.endswith("M") and 100 < float(m.details.parameter_size[:-1]) < 200
    for name in (NAME, "SmolLM2-135M-Instruct", "default"):
        shown = client.show(name)
        assert shown.modelinfo["llama.context_length"] == 8192
        assert "tools" in shown.capabilities and "num_ctx 8192" in shown.parameters and shown.template
    with pytest.raises(ollama.ResponseError) as e:
        client.show("llama3:8b")
    assert e.value.status_code == 404 and e.value.error == "model 'llama3:8b' not found"


def test_chat_streamed_and_not(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    r = client.chat(model=NAME, messages=messages, options=GREEDY)
    assert r.model == NAME and r.message.role == "assistant" and r.message.content
    durations_ok(r)
    parts = list(client.chat(model="default", messages=messages, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content for p in parts) == r.message.content  # greedy: the same text
    durations_ok(parts[-1])


def test_stream_is_the_default_and_ndjson(server):
    """Without `stream`, Ollama streams: one JSON object per line, the last one `done`."""
    r = server.http.post("/api/generate", json={"model": NAME, "prompt": "Count: one, two,", "options": GREEDY})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(x) for x in r.text.splitlines()]
    assert len(lines) >= 2 and lines[-1]["done"] and not lines[0]["done"]
    assert "context" not in lines[-1]  # no token context to hand back (documented)


def test_body_read_as_json_whatever_its_content_type(server):
    """Ollama's documented `curl URL -d '{...}'` sends the JSON form-typed; Ollama reads it all the same."""
    body = json.dumps({"model": NAME, "prompt": "hi", "stream": False, "options": GREEDY})
    r = server.http.post("/api/generate", content=body, headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200 and r.json()["done"]
    r = server.http.post("/api/show", content=json.dumps({"model": NAME}),
                         headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200 and r.json()["details"]["family"] == "llama"


def test_generate_system_raw_and_stream(client):
    r = client.generate(model=NAME, prompt="Count: one, two,", system="Answer in English.", options=GREEDY)
    durations_ok(r)
    assert r.response
    parts = list(client.generate(model=NAME, prompt="Count: one, two,", system="Answer in English.",
                                 options=GREEDY, stream=True))
    assert "".join(p.response for p in parts) == r.response
    raw = client.generate(model=NAME, prompt="one, two, three,", raw=True, options=GREEDY)
    assert raw.prompt_eval_count < r.prompt_eval_count  # no chat template around a raw prompt


def test_streamed_tool_call_arguments_parse(client):
    """One earlier call and its result in the history (Ollama's assistant tool_calls with arguments as an
    object, a tool message naming the tool) lead the small model to call the tool again, streamed."""
    history = [{"role": "user", "content": "What is the weather in Rome?"},
               {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                               "arguments": {"city": "Rome"}}}]},
               {"role": "tool", "tool_name": "get_weather", "content": "sunny"},
               {"role": "assistant", "content": "Sunny in Rome."},
               {"role": "user", "content": "What is the weather in Paris?"}]
    parts = list(client.chat(model=NAME, stream=True, tools=[WEATHER], messages=history,
                             options={"temperature": 0, "num_predict": 40}))
    calls = [c for p in parts for c in (p.message.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert calls[0].function.arguments == {"city": "Paris"}  # an object, as Ollama sends it
    assert parts[-1].done and parts[-1].done_reason == "stop" and not parts[-1].message.tool_calls

    def get_weather(city: str) -> str:
        """Current weather for a city.

        Args:
          city: The city's name
        """

    # not streamed, with the tool as the client derives it from a Python function
    r = client.chat(model=NAME, tools=[get_weather], messages=history, options={"temperature": 0, "num_predict": 40})
    assert r.message.tool_calls[0].function.arguments == {"city": "Paris"} and not r.message.content


def test_format_json_and_schema(client):
    r = client.chat(model=NAME, format="json", options={"temperature": 0, "num_predict": 30},
                    messages=[{"role": "user", "content": "A JSON object with your name."}])
    if r.done_reason == "stop":
        assert isinstance(json.loads(r.message.content), dict)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    r = client.generate(model=NAME, prompt="Is the sky blue? Answer in JSON.", format=schema,
                        options={"temperature": 0, "num_predict": 30})
    assert r.done_reason == "stop" and isinstance(json.loads(r.response)["ok"], bool)


def test_errors_in_ollama_shape(client, server):
    def error(path, body, status=400):
        r = server.http.post(path, json=body)
        assert r.status_code == status, r.text
        assert list(r.json()) == ["error"] and isinstance(r.json()["error"], str)
        return r.json()["error"]

    msg = [{"role": "user", "content": "hi"}]
    assert error("/api/chat", {"model": "nope", "messages": msg}, 404) == "model 'nope' not found"
    assert "images" in error("/api/chat", {"model": NAME, "messages": [{**msg[0], "images": ["aGk="]}]})
    assert "images" in error("/api/generate", {"model": NAME, "prompt": "hi", "images": ["aGk="]})
    assert "num_ctx" in error("/api/chat", {"model": NAME, "messages": msg, "options": {"num_ctx": 100000}})
    assert "exceeds the context length" in error("/api/generate", {"model": NAME, "prompt": "hi " * 9000})
    assert "exceeds the context length" in error("/api/chat", {"model": NAME, "messages": msg,
                                                               "options": {"num_ctx": 20, "num_predict": 10}})
    assert "temperature" in error("/api/chat", {"model": NAME, "messages": msg, "options": {"temperature": 9}})
    assert "keep_alive" in error("/api/chat", {"model": NAME, "messages": msg, "keep_alive": "soon"})
    assert "messages" in error("/api/chat", {"model": NAME, "messages": "hi"})
    assert "template" in error("/api/generate", {"model": NAME, "prompt": "hi", "template": "{{ .Prompt }}"})
    assert "model" in error("/api/chat", {"messages": msg})
    r = server.http.post("/api/chat", content=b'{"model": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    assert error("/api/show", {"model": "x"}, 404) == "model 'x' not found"
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="nope", messages=msg)
    assert e.value.status_code == 404


def test_keep_alive_zero_releases_and_the_next_request_reloads(client, server, serve_runtime):
    assert client.generate(model=NAME, keep_alive="5m").done_reason == "load"  # Ollama's load call
    (model,) = client.ps().models
    left = model.expires_at.timestamp() - time.time()
    assert model.model == NAME and 240 < left <= 300
    before = serve_runtime.residency()["resident_bytes"]
    r = client.generate(model=NAME, keep_alive=0)  # Ollama's unload call: no prompt, keep_alive 0
    assert r.done and r.done_reason == "unload"
    assert client.ps().models == []
    assert serve_runtime.residency()["resident_bytes"] < before
    # a request without keep_alive reloads and goes back to the server's own setting (here: never release)
    r = client.chat(model=NAME, messages=[{"role": "user", "content": "Say hello."}], options=GREEDY)
    assert r.done and r.message.content
    shown = client.ps().models
    assert [m.model for m in shown] == [NAME] and shown[0].size_vram == 0 and shown[0].size > 0
    assert shown[0].expires_at.year > 2200  # keep_alive -1: a far-off expiry
