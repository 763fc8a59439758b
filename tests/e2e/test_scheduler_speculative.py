"""The engine's speculative <-> batched switch on the real default model: a lone plain-greedy request
drafts (prompt lookup) and verifies over its own pages, several requests decode as a plain batch; greedy
tokens equal plain decoding either way and no page moves when the engine switches."""

import pytest

import justfit
from justfit.config import KVConfig
from justfit.phaseswap.drafting import PromptLookup
from justfit.engine import Engine

from tests.scheduler_support import greedy_alone

COPY = ("Copy this list exactly, one item per line: red apple, green pear, blue plum, yellow lemon, "
        "purple grape, orange peach, red apple, green pear, blue plum, yellow lemon, purple grape.")


@pytest.fixture(scope="module", params=[16, pytest.param(4, marks=pytest.mark.slow)])
def rt(request, default_model_dir, tmp_path_factory):
    """Small pages (a verify pass crosses page boundaries and seals pages); full precision and 4-bit."""
    return justfit.Runtime(model=str(default_model_dir), kv=KVConfig(bits=request.param, page_size=32),
                           home=tmp_path_factory.mktemp("spec-home"))


def _engine(rt, drafter=None):
    return Engine(rt.model, rt.tokenizer, rt.make_cache, index=rt.index, kv=rt.kv, drafter=drafter)


def _ids(rt, text):
    return rt.encode(text)  # (a cached prefix from an earlier test changes nothing: same tokens either way)


def test_lone_request_drafts_and_matches_plain_decoding(rt):
    ids = _ids(rt, COPY)
    spec = _engine(rt, PromptLookup()).submit(ids, max_tokens=48)
    g = spec.result()
    assert g.stats.draft_passes > 0 and g.stats.accepted_tokens > 0, g.stats  # the mechanism ran
    assert g.stats.drafter == "prompt-lookup"
    assert spec.engine.report()["accepted_tokens"] == g.stats.accepted_tokens
    plain = _engine(rt).submit(ids, max_tokens=48).result()
    assert plain.stats.draft_passes == 0
    assert g.tokens == plain.tokens == greedy_alone(rt, ids, 48)
    assert g.text == plain.text
    # fewer passes than tokens: accepted drafts came several per pass
    assert spec.engine.steps < plain.stats.generated_tokens + 1


def test_several_running_decode_plainly_then_the_survivor_drafts_in_place(rt):
    eng = _engine(rt, PromptLookup())
    long_ids, short_ids = _ids(rt, COPY), _ids(rt, "Say hi.")
    a = eng.submit(long_ids, max_tokens=40)
    b = eng.submit(short_ids, max_tokens=3)
    while not b.done:
        eng.step()
        assert eng.report()["draft_passes"] == 0  # two running: plain batched decode
    assert len(eng.scheduler.running) == 1 and eng.scheduler.running[0] is a
    table = list(a.caches[0].seq.table)
    passes = 0
    while not a.done:
        before = eng.report()["draft_passes"]
        eng.step()
        passes += eng.report()["draft_passes"] > before
        if a.caches is not None:
            assert a.caches[0].seq.table[:len(table) - 1] == table[:-1]  # its pages stayed where they were
    assert passes > 0
    assert a.out == greedy_alone(rt, long_ids, 40)
    assert b.out == greedy_alone(rt, short_ids, 3)


def test_sampled_or_processed_requests_never_draft(rt):
    eng = _engine(rt, PromptLookup())
    r = eng.submit(_ids(rt, COPY), max_tokens=12, repetition_penalty=1.3)
    assert r.result().tokens == rt.generate(COPY, max_tokens=12, repetition_penalty=1.3).tokens
    t = eng.submit(_ids(rt, COPY), max_tokens=12, temperature=0.8, seed=1)
    t.result()
    assert eng.report()["draft_passes"] == 0 and r.stats.drafter == "none"


def test_runtime_engine_uses_the_runtime_drafter(rt):
    eng = rt.batch_engine()
    assert eng.drafter is rt.drafter and eng.gate is rt.gate
    rt.set_drafter("none")
    assert eng.drafter is None
    g = rt.generate_batch([COPY], max_tokens=8)[0]
    assert g.stats.draft_passes == 0
    rt.set_drafter("prompt-lookup")
    assert eng.drafter is rt.drafter is not None
