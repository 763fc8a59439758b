"""Stats belong to the turn: two streams run interleaved, on the runtime or on two sessions, each report
their own prompt and generated tokens (no stream reads another's numbers from a shared field)."""

import uuid


def _interleave(a, b):
    """Step two streams in turn until both end; the texts they produced."""
    texts, live = {id(a): [], id(b): []}, [a, b]
    while live:
        for s in list(live):
            try:
                texts[id(s)].append(next(s).text)
            except StopIteration:
                live.remove(s)
    return "".join(texts[id(a)]), "".join(texts[id(b)])


def test_two_interleaved_runtime_streams_keep_their_own_stats(runtime16):
    rt = runtime16
    short = f"Say hi. {uuid.uuid4().hex[:6]}"
    long = f"List three colors, then three animals, then three fruits. {uuid.uuid4().hex[:6]}"
    a = rt.stream(short, max_tokens=3)
    b = rt.stream(long, max_tokens=9)
    _interleave(a, b)
    assert a.stats is not b.stats
    assert a.stats.prompt_tokens == len(rt.encode(short))
    assert b.stats.prompt_tokens == len(rt.encode(long))
    assert a.stats.generated_tokens <= 3 < b.stats.generated_tokens or b.stats.finish_reason == "stop"
    assert rt.generate(short, max_tokens=3).stats.prompt_tokens == a.stats.prompt_tokens


def test_two_interleaved_session_turns_keep_their_own_stats(runtime16):
    rt = runtime16
    s1, s2 = rt.session(None), rt.session(None)
    p1 = f"Name a color. {uuid.uuid4().hex[:6]}"
    p2 = f"Name three large animals that live in Africa, one per line. {uuid.uuid4().hex[:6]}"
    a, b = s1.stream(p1, max_tokens=2), s2.stream(p2, max_tokens=6)
    _interleave(a, b)
    assert a.stats is not b.stats
    assert s1.last_stats is a.stats and s2.last_stats is b.stats
    assert a.stats.history_tokens == len(s1.tokens) and b.stats.history_tokens == len(s2.tokens)
    assert a.stats.prompt_tokens < b.stats.prompt_tokens  # p2 is the longer prompt
    assert a.stats.generated_tokens <= 2 and b.stats.generated_tokens <= 6
