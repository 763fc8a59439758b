"""End to end on the real default model (SmolLM2-135M-Instruct) with full-precision KV."""

import pytest


def test_greedy_answer_names_paris(runtime16):
    g = runtime16.generate("What is the capital of France?", max_tokens=16, temperature=0.0)
    assert "Paris" in g.text
    assert g.stats.prompt_tokens > 10
    assert g.stats.ttft_s > 0 and g.stats.peak_memory_bytes > 0


def test_chat_template_is_applied(runtime16):
    tok = runtime16.tokenizer
    ids = runtime16.encode("hello there")
    text = tok.decode(ids)
    assert text.count("<|im_start|>") >= 2  # the template's system turn, then the user turn
    assert "<|im_start|>user\nhello there<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_eos_stops_generation(runtime16):
    g = runtime16.generate("Say just the word yes.", max_tokens=64)
    assert g.stats.finish_reason == "stop"
    assert g.stats.generated_tokens < 64
    assert runtime16.tokenizer.eos_token_id not in g.tokens


def test_stream_matches_generate(runtime16):
    msgs = [{"role": "user", "content": "Name a color."}]
    whole = runtime16.generate(msgs, max_tokens=8)
    chunks = list(runtime16.stream(msgs, max_tokens=8))
    assert "".join(c.text for c in chunks) == whole.text
    assert [c.token for c in chunks if c.token >= 0] == whole.tokens


def test_max_tokens_bounds_the_reply(runtime16):
    g = runtime16.generate("Count from one to one hundred in words.", max_tokens=5)
    assert len(g.tokens) == 5 and g.stats.finish_reason == "length"


def test_bad_prompt_is_a_user_error(runtime16):
    from justfit import UserError

    with pytest.raises(UserError):
        runtime16.generate(42)
    with pytest.raises(UserError):
        runtime16.generate("hi", max_tokens=0)


def test_seeded_sampling_is_reproducible(runtime16):
    a = runtime16.generate("Tell me a word.", max_tokens=6, temperature=1.0, seed=7)
    b = runtime16.generate("Tell me a word.", max_tokens=6, temperature=1.0, seed=7)
    assert a.tokens == b.tokens


@pytest.mark.parametrize("prompt, max_tokens", [("Say just the word yes.", 64), ("Write a long story about a dragon who guards a library.", 20)])
def test_overlapped_decode_equals_stepwise_and_feeds_every_token(runtime16, prompt, max_tokens):
    """Plain decoding builds each step on the pending token before reading it; a logits processor makes every
    step wait for its token instead. Both give the same ids, ending at end-of-turn or at max_tokens, and
    leave every yielded id (end-of-turn included) in the cache, as the next turn expects."""
    ids, eos = runtime16.encode(prompt), set(runtime16.tokenizer.eos_token_ids)
    runs = []
    for processors in ((), (lambda seen, logits: logits,)):
        cache, fed = runtime16.make_cache(), []
        list(runtime16.stream_tokens(ids, cache, max_tokens, logits_processors=processors, fed=fed))
        runs.append((fed, cache[0].offset))
    (overlapped, fed), (stepwise, fed_stepwise) = runs
    assert overlapped == stepwise
    assert fed == fed_stepwise == len(ids) + len(overlapped)
    assert (overlapped[-1] in eos) if prompt.startswith("Say") else len(overlapped) == max_tokens
