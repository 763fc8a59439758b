"""`POST /v1/messages` (Anthropic's Messages API) on the default model, in process, driven by the official
`anthropic` SDK: text and tool_use replies, streamed and not, a tool_use -> tool_result round trip, stop
sequences, count_tokens, cached prefix tokens on a second turn, and the errors the SDK raises as its own
classes; then (slow) the real Claude Code CLI against `justfit serve`."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.server_support import InProcess, Served

anthropic = pytest.importorskip("anthropic")

SYSTEM = ("You are a terse assistant for a weather service. " + " ".join(
    f"Rule {i}: answer in one short sentence and never invent a city that was not named." for i in range(40)))
WEATHER = {"name": "get_weather", "description": "Current weather for a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}  # the SDK no longer takes sampling parameters; the server reads them


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120,
                               http_client=server.http)


def test_text_reply_and_usage(client):
    r = client.messages.create(model="claude-sonnet-4-5", max_tokens=6, messages=ASK, extra_body=GREEDY | {"top_k": 40},
                               system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
                               metadata={"user_id": "u1"}, service_tier="auto")
    assert r.id.startswith("msg_") and r.type == "message" and r.role == "assistant"
    assert r.model == "SmolLM2-135M-Instruct"
    assert [b.type for b in r.content] == ["text"] and r.content[0].text
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 6
    counted = client.messages.count_tokens(model="claude-sonnet-4-5", messages=ASK,
                                           system=[{"type": "text", "text": "Be brief."}]).input_tokens
    u = r.usage
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == counted


def test_stop_sequence_is_reported(client):
    ask = dict(model="claude-haiku-4-5", max_tokens=12, extra_body=GREEDY, messages=ASK)
    text = client.messages.create(**ask).content[0].text
    word = text.split()[1]  # a word the greedy reply writes after its first
    r = client.messages.create(**ask, stop_sequences=[word])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == word, (text, r)
    assert word not in r.content[0].text and text.startswith(r.content[0].text)


def test_prefill_continues_the_final_assistant_message(client, serve_runtime):
    start = "The weather in Paris is"
    count = lambda messages: client.messages.count_tokens(model="claude-x", messages=messages).input_tokens  # noqa: E731
    turn = ASK + [{"role": "assistant", "content": start}]
    assert count(turn) == count(ASK) + len(serve_runtime.tokenizer.encode(start, add_special_tokens=False))
    r = client.messages.create(model="claude-x", max_tokens=3, messages=turn, extra_body=GREEDY,
                               tools=[WEATHER], tool_choice={"type": "auto"})
    assert [b.type for b in r.content] == ["text"] and not r.content[0].text.startswith(start)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="claude-x", max_tokens=3, messages=ASK + [{"role": "assistant", "content": "It is "}])
    assert "trailing whitespace" in e.value.message


def test_tool_use_then_tool_result(client):
    r = client.messages.create(model="claude-sonnet-4-5", max_tokens=40, extra_body=GREEDY, system=SYSTEM,
                               tools=[WEATHER], tool_choice={"type": "any"}, messages=ASK)
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"]
    use = r.content[0]
    assert use.id.startswith("toolu_") and use.name == "get_weather" and isinstance(use.input["city"], str)
    turn = ASK + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": [{"type": "text", "text": "18 C, sunny"}]}]}]
    again = client.messages.create(model="claude-sonnet-4-5", max_tokens=8, extra_body=GREEDY, system=SYSTEM,
                                   tools=[WEATHER], tool_choice={"type": "none"}, messages=turn)
    assert [b.type for b in again.content] == ["text"] and again.stop_reason in ("end_turn", "max_tokens")
    # the second turn starts with the first one's prompt: its prefix is read from the cache
    assert again.usage.cache_read_input_tokens > 0.8 * r.usage.input_tokens, again.usage


def test_stream_tool_use_events(client):
    with client.messages.stream(model="claude-sonnet-4-5", max_tokens=40, extra_body=GREEDY, system=SYSTEM,
                                tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
                                messages=ASK) as stream:
        kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == ("message_start", None) and kinds[1] == ("content_block_start", None)
    assert ("content_block_delta", "input_json_delta") in kinds
    assert kinds[-3:] == [("content_block_stop", None), ("message_delta", None), ("message_stop", None)]
    assert final.stop_reason == "tool_use" and final.content[0].type == "tool_use"
    assert isinstance(final.content[0].input["city"], str)
    assert final.usage.output_tokens > 0 and final.usage.cache_read_input_tokens > 0  # SYSTEM ran before


def test_stream_text_wire_format(server):
    body = {"model": "claude-x", "max_tokens": 5, "temperature": 0, "stream": True, "messages": ASK}
    with server.http.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    events = [line[7:] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert events == [d["type"] for d in data]
    assert events[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert events[-4:] == ["content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert data[2]["content_block"] == {"type": "text", "text": ""}
    assert data[-2]["delta"]["stop_reason"] == "max_tokens" and data[-2]["usage"]["output_tokens"] == 5


def test_errors_are_the_sdks_own_classes(client, server):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="claude-x", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                       "data": "iVBORw0KGgo="}}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error" and "'image'" in e.value.message
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="claude-x", max_tokens=4, messages=ASK,
                               tools=[{"type": "bash_20250124", "name": "bash"}])
    assert "bash_20250124" in e.value.message
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="gpt-4o", max_tokens=4, messages=ASK)
    r = server.http.post("/v1/messages", json={"model": "claude-x", "messages": ASK})  # no max_tokens
    assert r.status_code == 400 and r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "missing required field 'max_tokens'"}}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="claude-x", max_tokens=4,
                               messages=[{"role": "user", "content": "weather " * 9000}])
    assert "prompt is too long: " in e.value.message and "tokens > 8191 maximum" in e.value.message
    r = server.http.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("the request body is not valid JSON")
    r = server.http.post("/v1/messages/nothing", json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_auth_size_and_cors_for_anthropic_clients(serve_runtime):
    s = InProcess(serve_runtime, api_key="sk-k", max_body=4096, cors="http://app.test")
    try:
        asked = {"origin": "http://app.test", "access-control-request-method": "POST",
                 "access-control-request-headers": "x-api-key,anthropic-version,anthropic-beta,content-type"}
        assert s.http.options("/v1/messages", headers=asked).status_code == 200  # a browser may send them
        bad = anthropic.Anthropic(base_url=s.url, api_key="wrong", max_retries=0, http_client=s.http)
        with pytest.raises(anthropic.AuthenticationError) as e:
            bad.messages.count_tokens(model="claude-x", messages=ASK)
        assert e.value.body["error"]["type"] == "authentication_error"
        good = anthropic.Anthropic(base_url=s.url, api_key="sk-k", max_retries=0, http_client=s.http)
        assert good.messages.count_tokens(model="claude-x", messages=ASK).input_tokens > 0
        with pytest.raises(anthropic.APIStatusError) as e:
            good.messages.count_tokens(model="claude-x", messages=[{"role": "user", "content": "x" * 5000}])
        assert e.value.status_code == 413 and e.value.body["error"]["type"] == "request_too_large"
        openai_shape = s.http.post("/v1/chat/completions", json={}, headers={"x-api-key": "wrong"}).json()
        assert openai_shape["error"]["code"] == "invalid_api_key"  # the OpenAI paths keep their envelope
    finally:
        s.stop()


# -- Claude Code ---------------------------------------------------------------------------------
def ending_model(default_model_dir, root: Path) -> Path:
    """The 32k-context tiny model made to answer "hi" and end its turn: every layer adds nothing, every
    token embeds alike, and the output head ranks the end-of-turn token first and "hi" second (the tool
    grammar forbids an empty answer, so "hi" comes first). Random weights would write until max_tokens,
    which Claude Code reports as an error."""
    import mlx.core as mx
    from transformers import AutoTokenizer

    from tests.agents_support import tiny_model_folder

    src = tiny_model_folder(default_model_dir, root, context=32768)
    out = root / "tiny-ends-turn"
    if (out / "config.json").exists():
        return out
    out.mkdir()
    config = json.loads((src / "config.json").read_text())
    config["tie_word_embeddings"] = False
    tok = AutoTokenizer.from_pretrained(str(src))
    weights = mx.load(str(src / "model.safetensors"))
    for k in weights:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            weights[k] = mx.zeros_like(weights[k])
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    weights["model.embed_tokens.weight"] = mx.ones((vocab, hidden))
    head = mx.zeros((vocab, hidden))
    head[tok.convert_tokens_to_ids("<|im_end|>")] = 1.0
    head[tok.encode("hi", add_special_tokens=False)[0]] = 0.5
    weights["lm_head.weight"] = head
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (out / f.name).write_bytes(f.read_bytes())
    (out / "config.json").write_text(json.dumps(config))
    return out


def claude(cli: str, url: str, home: Path, *args: str) -> subprocess.CompletedProcess:
    """Claude Code in print mode against the local server only: its own home, no telemetry, updates,
    error reports or other traffic; the output budget as the CLI sets it by default."""
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "CLAUDE_CONFIG_DIR": str(home / ".claude"),
           "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "dummy", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
           "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1"}
    return subprocess.run([cli, "-p", *args], env=env, cwd=str(home), capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_claude_code_talks_to_justfit_serve(default_model_dir, tmp_path):
    import re

    from tests.agent_clis import find_cli

    cli = find_cli("claude")
    model = ending_model(default_model_dir, tmp_path)
    server = Served(tmp_path, str(model))
    try:
        first = claude(cli, server.url, tmp_path, "say hi")
        assert first.returncode == 0 and "hi" in first.stdout, (first.stdout, first.stderr, server.text())
        again = claude(cli, server.url, tmp_path, "--continue", "say hi again")
        assert again.returncode == 0, (again.stdout, again.stderr, server.text())
        turns = re.findall(r"POST /v1/messages 200 \S+ prompt=(\d+) cached=(\d+)", server.text())
        prompt, cached = map(int, turns[-1])
        print(f"claude -p: exit {first.returncode} ({first.stdout.strip()!r}), then --continue: exit "
              f"{again.returncode}; {len(turns)} requests, the last: prompt {prompt} tokens, cached {cached}")
        assert cached > 0.9 * prompt, server.text()
    finally:
        server.stop()
