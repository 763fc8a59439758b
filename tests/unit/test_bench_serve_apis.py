"""bench serve reads each API's stream the way its clients do: pieces for TTFT and gaps, and the usage that
says how many prompt tokens were cached (chat: the final chunk; Responses: response.completed or, for a reply
cut at max_output_tokens, response.incomplete; Messages: message_delta's final usage)."""

from justfit.bench.serve_apis import Reading, body


def _read(api, events):
    r = Reading(0.0)
    for e in events:
        r.event(api, e)
    return r.record()


def test_each_api_reports_prompt_and_cached_tokens():
    chat = _read("chat", [{"choices": [{"delta": {"content": "a"}}]}, {"choices": [{"delta": {"content": "b"}}]},
                          {"choices": [], "usage": {"prompt_tokens": 900, "completion_tokens": 2,
                                                    "prompt_tokens_details": {"cached_tokens": 800}}}])
    assert (chat["prompt_tokens"], chat["cached_tokens"], chat["completion_tokens"], len(chat["gaps"])) == (900, 800, 2, 1)
    usage = {"input_tokens": 900, "output_tokens": 2, "input_tokens_details": {"cached_tokens": 800}}
    for end in ("response.completed", "response.incomplete"):
        resp = _read("responses", [{"type": "response.output_text.delta", "delta": "a"},
                                   {"type": end, "response": {"usage": usage}}])
        assert (resp["prompt_tokens"], resp["cached_tokens"]) == (900, 800), end
    msgs = _read("messages", [
        {"type": "message_start", "message": {"usage": {"input_tokens": 900, "cache_read_input_tokens": 0}}},
        {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "a"}},
        {"type": "message_delta", "usage": {"output_tokens": 2, "input_tokens": 100, "cache_read_input_tokens": 800,
                                            "cache_creation_input_tokens": 0}}])
    assert (msgs["prompt_tokens"], msgs["cached_tokens"], msgs["completion_tokens"]) == (900, 800, 2)


def test_the_same_conversation_in_each_apis_shape():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
    assert body("chat", "m", msgs, 4, "k")["messages"] == msgs
    r = body("responses", "m", msgs, 4, "k")
    assert r["instructions"] == "S" and [i["role"] for i in r["input"]] == ["user", "assistant"]
    a = body("messages", "m", msgs, 4, "k")
    assert a["system"] == "S" and [m["role"] for m in a["messages"]] == ["user", "assistant"]
