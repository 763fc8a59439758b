"""The Ollama front's translation, without a model: keep_alive durations, the reply budget against the
context and num_ctx, messages into the chat front's, options into the engine request, and the
parameter count read from a safetensors header."""

import json
import struct
from types import SimpleNamespace

import pytest

from justfit.server.errors import APIError, error_body
from justfit.server.ollama import Turn, budget, chat_messages, keep_alive_seconds
from justfit.server.ollama_info import _parameters, check_model
from justfit.server.ollama_schema import ChatBody, Options, engine_request


@pytest.mark.parametrize("value, seconds", [(0, 0.0), ("0", 0.0), (30, 30.0), ("5m", 300.0), ("1h30m", 5400.0),
                                            ("1.5s", 1.5), ("250ms", 0.25), (-1, None), ("-1m", None), ("-1", None)])
def test_keep_alive_durations(value, seconds):
    assert keep_alive_seconds(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5 m", "m", "", "5mm"])
def test_keep_alive_refuses_what_is_not_a_duration(value):
    with pytest.raises(APIError) as e:
        keep_alive_seconds(value)
    assert e.value.status == 400 and "keep_alive" in e.value.message


def test_budget_is_the_rest_of_the_context_and_refuses_overflow():
    srv = SimpleNamespace(context=100)
    assert budget(srv, Options(), 30) == 70  # num_predict absent: up to the context, as Ollama's -1
    assert budget(srv, Options(num_predict=-2), 30) == 70
    assert budget(srv, Options(num_predict=5), 30) == 5
    assert budget(srv, Options(num_ctx=50), 30) == 20
    for options, n in ((Options(), 100), (Options(num_predict=71), 30), (Options(num_ctx=30), 30)):
        with pytest.raises(APIError) as e:
            budget(srv, options, n)
        assert e.value.status == 400 and "exceeds the context length" in e.value.message
    with pytest.raises(APIError, match="num_ctx 101 is over"):
        budget(srv, Options(num_ctx=101), 1)


def test_messages_tool_calls_and_results():
    body = ChatBody(model="m", messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "sunny"},  # no tool_name: the last call's
        {"role": "tool", "tool_name": "other", "content": "x"}])
    out = chat_messages(body)
    assert json.loads(out[1]["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    assert out[2] == {"role": "function", "name": "get_weather", "content": "sunny"}
    assert out[3]["name"] == "other"
    with pytest.raises(APIError, match="tool_name"):
        chat_messages(ChatBody(model="m", messages=[{"role": "tool", "content": "x"}]))
    with pytest.raises(APIError, match="images"):
        chat_messages(ChatBody(model="m", messages=[{"role": "user", "content": "x", "images": ["aGk="]}]))


def test_options_reach_the_engine_request_with_ollama_defaults():
    msgs = [{"role": "user", "content": "hi"}]
    body = ChatBody.model_validate({"model": "m", "messages": msgs, "options": None, "stream": None, "format": None})
    assert body.stream and body.options == Options()  # null is the default, as in Ollama
    req = engine_request("m", msgs, body)
    assert (req.temperature, req.top_k, req.top_p, req.seed, req.repetition_penalty) == (0.8, 40, 0.9, None, None)
    body = ChatBody(model="m", messages=msgs, format={"type": "object"}, options={
        "temperature": 0, "top_k": 5, "top_p": 0.5, "seed": -1, "repeat_penalty": 1.2, "stop": ["x"], "mirostat": 2})
    req = engine_request("m", msgs, body)
    assert (req.temperature, req.top_k, req.top_p, req.seed, req.repetition_penalty) == (0, 5, 0.5, None, 1.2)
    assert req.stop == ["x"] and req.response_format.json_schema.strict
    assert engine_request("m", msgs, ChatBody(model="m", messages=msgs, format="json")).response_format.type == "json_object"
    with pytest.raises(APIError, match="^stop: takes up to 4"):  # the chat front's limit of 4 stop strings
        engine_request("m", msgs, ChatBody(model="m", messages=msgs, options={"stop": list("abcde")}))


def test_model_names_and_the_error_envelope():
    from justfit.server.pool import ModelPool, Served

    pool = ModelPool(None, None)
    pool.add(Served("spec", "/models/Model-1", None, primary=True))
    srv = SimpleNamespace(pool=pool)
    for name in ("Model-1", "Model-1:latest", "default", "default:latest"):
        check_model(srv, name)
    with pytest.raises(APIError) as e:
        check_model(srv, "Model-1:7b")
    assert e.value.status == 404 and e.value.message == "model 'Model-1:7b' not found"
    assert error_body("/api/chat", 404, "gone", "model", "x") == {"error": "gone"}
    assert "type" in error_body("/v1/chat/completions", 404, "gone")["error"]


def test_parameter_count_from_the_header(tmp_path):
    header = {"q.weight": {"dtype": "U32", "shape": [8, 4], "data_offsets": [0, 0]},
              "q.scales": {"dtype": "F16", "shape": [8, 1], "data_offsets": [0, 0]},
              "q.biases": {"dtype": "F16", "shape": [8, 1], "data_offsets": [0, 0]},
              "e.weight": {"dtype": "U32", "shape": [2, 4], "data_offsets": [0, 0]},
              "e.scales": {"dtype": "F16", "shape": [2, 1], "data_offsets": [0, 0]},
              "norm.weight": {"dtype": "F16", "shape": [16], "data_offsets": [0, 0]}, "__metadata__": {}}
    raw = json.dumps(header).encode()
    f = tmp_path / "model.safetensors"
    f.write_bytes(struct.pack("<Q", len(raw)) + raw)
    # q: 32 words of 4-bit values; e: 8 words of 8-bit values (a per-layer override); norm: 16 plain
    assert _parameters(f, {"bits": 4, "e": {"bits": 8}}) == 32 * 8 + 8 * 4 + 16


def test_closing_fields_in_nanoseconds():
    turn = Turn(None, 12)
    turn.start -= 1.0  # a reply that took a second
    out = turn.closing(None, {"ttft_s": 0.3, "queue_s": 0.1, "generated_tokens": 5, "finish_reason": "length"})
    assert out["done"] and out["done_reason"] == "length" and (out["prompt_eval_count"], out["eval_count"]) == (12, 5)
    assert out["prompt_eval_duration"] == pytest.approx(0.2e9, rel=0.01)  # the admission wait left out
    assert out["eval_duration"] == pytest.approx(out["total_duration"] - 0.3e9, rel=0.01)
    assert out["total_duration"] >= 1e9
    assert turn.closing({"name": "f", "arguments": "{}"}, {"finish_reason": "length"})["done_reason"] == "stop"
