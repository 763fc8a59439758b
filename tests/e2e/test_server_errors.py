"""The server under bad input and rude clients: 30 kinds of bad request each get a 4xx in OpenAI's
error envelope (the app in process, with an API key and a body cap), a client that disconnects
mid-stream over a real socket cancels its generation and frees its pages (a `justfit serve` process;
marked slow, since test_server_batching's default test checks the same cancel and page release), and
the server stays healthy throughout. Also: non-loopback binds without a key are refused."""

import json
import re
import subprocess
import sys
import time

import httpx
import pytest

from tests.server_support import ROOT, InProcess, Served, openapi_validator

KEY = "sk-test-123"
AUTH = {"authorization": f"Bearer {KEY}"}
MSG = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def server(serve_runtime):
    s = InProcess(serve_runtime, api_key=KEY, max_body=65536)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def served(default_model_dir, tmp_path_factory):
    """A real process, for the disconnect over a socket."""
    s = Served(tmp_path_factory.mktemp("serve-errors"), str(default_model_dir), "--api-key", KEY,
               "--max-body", "65536")
    yield s
    s.stop()


def chat(**over):
    return {"model": "default", "messages": MSG, "max_tokens": 2, **over}


BAD_JSON = [  # (what, path, body) sent as JSON
    ("body is a list", "/v1/chat/completions", [1, 2]),
    ("no messages", "/v1/chat/completions", {"model": "default"}),
    ("empty messages", "/v1/chat/completions", chat(messages=[])),
    ("unknown role", "/v1/chat/completions", chat(messages=[{"role": "robot", "content": "x"}])),
    ("no model", "/v1/chat/completions", {"messages": MSG}),
    ("unknown model", "/v1/chat/completions", chat(model="gpt-9")),
    ("temperature too high", "/v1/chat/completions", chat(temperature=3)),
    ("top_p zero", "/v1/chat/completions", chat(top_p=0)),
    ("max_tokens zero", "/v1/chat/completions", chat(max_tokens=0)),
    ("n too large", "/v1/chat/completions", chat(n=100)),
    ("frequency_penalty out of range", "/v1/chat/completions", chat(frequency_penalty=5)),
    ("image part", "/v1/chat/completions", chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])),
    ("required without tools", "/v1/chat/completions", chat(tool_choice="required")),
    ("named tool not in tools", "/v1/chat/completions", chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}})),
    ("bad tool name", "/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "has space"}}])),
    ("duplicate tool names", "/v1/chat/completions", chat(tools=[TOOL, TOOL])),
    ("bad tool schema", "/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}])),
    ("json_schema without schema", "/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}})),
    ("bad json_schema", "/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}})),
    ("unknown response_format", "/v1/chat/completions", chat(response_format={"type": "yaml"})),
    ("tool result for no call", "/v1/chat/completions", chat(messages=MSG + [{"role": "tool", "tool_call_id": "nope", "content": "1"}])),
    ("call arguments not JSON", "/v1/chat/completions", chat(messages=MSG + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}])),
    ("five stop strings", "/v1/chat/completions", chat(stop=["a", "b", "c", "d", "e"])),
    ("logit_bias key not a token", "/v1/chat/completions", chat(logit_bias={"abc": 1})),
    ("context overflow", "/v1/chat/completions", chat(max_tokens=100000)),
    ("bad session name", "/v1/chat/completions", chat(prompt_cache_key="../../etc")),
    ("empty completion prompt", "/v1/completions", {"model": "default", "prompt": ""}),
    ("completion suffix", "/v1/completions", {"model": "default", "prompt": "a", "suffix": "b"}),
    ("token id out of vocab", "/v1/completions", {"model": "default", "prompt": [10**9]}),
]


def check_envelope(r: httpx.Response, status=None):
    assert 400 <= r.status_code < 500 and (status is None or r.status_code == status), (r.status_code, r.text)
    body = r.json()
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"], body
    assert not list(openapi_validator("ErrorResponse").iter_errors(body))
    return body["error"]


@pytest.mark.parametrize("what,path,body", BAD_JSON, ids=[b[0] for b in BAD_JSON])
def test_bad_json_requests_get_the_envelope(server, what, path, body):
    err = check_envelope(server.http.post(path, json=body, headers=AUTH), 400)
    assert "Traceback" not in err["message"]


def test_bad_transport_requests(server):
    h = server.http
    check_envelope(h.post("/v1/chat/completions", content=b"{not json", headers={**AUTH, "content-type": "application/json"}), 400)
    check_envelope(h.post("/v1/chat/completions", json=chat(), headers={}), 401)
    check_envelope(h.post("/v1/chat/completions", json=chat(), headers={"authorization": "Bearer sk-test-124"}), 401)
    check_envelope(h.get("/v1/models"), 401)
    check_envelope(h.post("/v1/chat/completions", json=chat(messages=[{"role": "user", "content": "x" * 70000}]), headers=AUTH), 413)
    check_envelope(h.get("/v1/nothing", headers=AUTH), 404)
    check_envelope(h.get("/v1/chat/completions", headers=AUTH), 405)
    check_envelope(h.get("/v1/models/gpt-9", headers=AUTH), 404)
    assert h.get("/health").json()["status"] == "ok"  # open without the key: for load balancers
    assert h.get("/v1/models", headers=AUTH).status_code == 200


def _pages(url: str) -> int:
    m = re.search(r'justfit_pool_pages\{state="used"\} (\d+)', httpx.get(url + "/metrics", headers=AUTH).text)
    return int(m.group(1))


def _counter(url: str, name: str) -> int:
    return int(re.search(name + r" (\d+)", httpx.get(url + "/metrics", headers=AUTH).text).group(1))


def _cancelled(url: str) -> int:
    return _counter(url, "justfit_cancelled_requests_total")


def _cancel_one(server):
    """Stream a long reply, leave after a few chunks, wait until the server has dropped the request."""
    cancelled = _cancelled(server.url)
    body = chat(max_tokens=2000, temperature=0, stream=True,
                messages=[{"role": "user", "content": "Write a very long story about a lighthouse."}])
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 4:
                break  # leave: the connection closes with the context
    deadline = time.time() + 60
    while time.time() < deadline and (_cancelled(server.url) == cancelled or
                                      httpx.get(server.url + "/health").json()["queue_length"]):
        time.sleep(0.2)
    assert _cancelled(server.url) == cancelled + 1


@pytest.mark.slow
def test_disconnect_mid_stream_cancels_and_frees_pages(served):
    server = served
    before = _pages(server.url)
    generated = _counter(server.url, "justfit_completion_tokens_total")
    _cancel_one(server)
    assert _counter(server.url, "justfit_completion_tokens_total") - generated < 200  # stopped early, not at 2000
    # the prefix index may keep the turn's one open page for reuse; the request's own pages are released,
    # so cancelling the same request again leaves the pool where it was
    after = _pages(server.url)
    assert after - before <= 1
    _cancel_one(server)
    assert _pages(server.url) == after
    # and the server still answers
    r = httpx.post(server.url + "/v1/chat/completions", json=chat(), headers=AUTH, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None


def test_refuses_public_bind_without_key(tmp_path):
    r = subprocess.run([sys.executable, "-m", "justfit", "serve", "--host", "0.0.0.0", "--port", "1"],
                       capture_output=True, text=True, timeout=120, cwd=str(ROOT),
                       env={"PATH": "/usr/bin:/bin", "JUSTFIT_HOME": str(tmp_path), "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and "refusing to serve on 0.0.0.0 without --api-key" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_stream_errors_after_start_are_in_band(server):
    # an error raised after the stream began still ends it with an envelope, never a broken socket
    body = chat(stream=True, prompt_cache_key="../bad")
    r = server.http.post("/v1/chat/completions", json=body, headers=AUTH)
    lines = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    assert r.status_code == 400 or any("error" in x for x in lines)
