"""The engine's scheduler and Request with no model: a fake KV manager answers every byte question, so the
policy (who is admitted, what each request computes in a step, who is preempted) is checked alone."""

from justfit.engine.request import QUEUED, RUNNING, WAITING, Request
from justfit.engine.sampling import Sampling
from justfit.engine.scheduler import PREFILL_STEP, PREFILL_WITH_DECODE, Scheduler


class FakeDetok:
    def __init__(self):
        self.tokens, self.last_segment = [], ""

    def reset(self):
        self.tokens = []

    def add_token(self, t):
        self.tokens.append(t)
        self.last_segment = f"<{t}>"

    def finalize(self):
        self.last_segment = ""


class FakeTokenizer:
    @property
    def detokenizer(self):
        return FakeDetok()


class FakeKV:
    """One byte a token; pages of 4 tokens; optional budget; prefixes indexed by the caller."""

    def __init__(self, budget=None, prefixes=None):
        self.page_size, self.budget, self.used = 4, budget, 0
        self.prefixes = prefixes or {}  # tuple(prefix) -> attached on admission
        self.switched, self.preempted = [], []

    def attach(self, r):
        r.caches = ["layer"]
        return max((len(p) for p in self.prefixes if tuple(r.feed[:len(p)]) == p and len(p) < len(r.feed)),
                   default=0)

    def detach(self, r):
        r.caches = None

    def seq_bytes(self, n):
        return n

    def grow_bytes(self, cached, n):
        return n

    def fits(self, need):
        return self.budget is None or self.used + need <= self.budget

    def reserve(self, plan):
        self.used += sum(n for _, n in plan)

    def preempt(self, r):
        self.used -= r.cached
        self.preempted.append(r)
        r.caches = None

    def batched(self, requests):
        self.switched.append([r.id for r in requests])


def request(rid, n_prompt, max_tokens=8, **sampling):
    return Request(None, rid, list(range(100 * rid + 1, 100 * rid + 1 + n_prompt)), max_tokens,
                   Sampling(**sampling), FakeTokenizer())


def decoding(r):
    """Put r in the state after its prompt was computed and one token was sampled."""
    r.cached = len(r.feed)
    r.out.append(7)
    r.feed.append(7)
    return r


def test_a_lone_prompt_prefills_in_long_chunks_and_decoders_go_first_beside_a_capped_chunk():
    s = Scheduler(FakeKV())
    long = request(1, 2000)
    s.add(long)
    s.admit()
    assert s.schedule() == [(long, min(PREFILL_STEP, 1999))]  # alone: a decoder-stack chunk, its last token apart
    dec = decoding(request(2, 10))
    s.running.insert(0, dec)
    plan = s.schedule()
    assert plan[0] == (dec, 1)  # decoders first
    assert plan[1] == (long, PREFILL_WITH_DECODE)  # a long prefill never stalls them for more than one chunk


def test_admission_is_oldest_first_and_nobody_overtakes_a_request_waiting_for_memory():
    kv = FakeKV(budget=100)
    s = Scheduler(kv)
    a, b, c = request(1, 60), request(2, 60), request(3, 5)
    s.add(a)
    s.admit()
    assert s.running == [a] and a.state == RUNNING
    kv.used = 60  # a's pages are computed
    s.add(b)
    s.add(c)
    s.admit()
    assert s.running == [a]
    assert list(s.queue) == [b, c] and b.state == QUEUED and c.state == QUEUED  # c fits but must not overtake b
    assert b.caches is None and c.caches is None  # what was attached to try them was released


def test_the_youngest_is_preempted_when_a_step_does_not_fit_and_requeued_first():
    kv = FakeKV(budget=30)
    s = Scheduler(kv)
    old, young = request(1, 10), request(2, 10)
    s.add(old)
    s.add(young)
    s.admit()
    assert s.running == [old, young]
    kv.used = 25  # memory ran short since admission
    plan = s.schedule()
    assert kv.preempted == [young] and s.preempted == 1
    assert plan == [(old, 10)]
    assert list(s.queue) == [young] and young.state == QUEUED and young.cached == 0 and young.preemptions == 1


def test_a_request_waits_for_the_pages_a_running_request_is_still_computing():
    s = Scheduler(FakeKV())
    leader = request(1, 12)
    s.add(leader)
    s.admit()
    follower = Request(None, 2, leader.prompt[:8] + [999, 998], 8, Sampling(), FakeTokenizer())
    s.add(follower)
    s.admit()
    assert follower.state == WAITING and follower not in s.running and follower.caches is None
    leader.cached = 8  # its first two pages are computed (and published): the follower may attach them
    s.admit()
    assert follower.state == RUNNING


def test_company_switches_every_running_request_to_batched_caches():
    kv = FakeKV()
    s = Scheduler(kv)
    s.add(request(1, 4))
    s.admit()
    assert kv.switched == []  # alone: keeps its single-sequence mode
    s.add(request(2, 4))
    s.admit()
    assert kv.switched == [[1, 2]]


def test_only_a_lone_plain_greedy_decoder_may_draft_and_only_pure_decode_steps_queue_ahead():
    s = Scheduler(FakeKV())
    r = decoding(request(1, 4))
    s.running.append(r)
    assert s.lone() is r
    assert s.decode_only_next([(r, 1)]) is None  # r has a token to read first (its row is not computed)
    r.cached += 1
    assert s.decode_only_next([(r, 1)]) == [(r, 1)]
    s.add(request(2, 4))
    assert s.decode_only_next([(r, 1)]) is None  # somebody waits for admission
    hot = decoding(request(3, 4, temperature=0.7))
    s2 = Scheduler(FakeKV())
    s2.running.append(hot)
    assert s2.lone() is None


class FakeConstraint:
    """Forces two tokens after the first sampled one, then is done."""

    def __init__(self):
        self.seen, self.done = [], False

    def apply(self, logits):
        return logits

    def advance(self, tok):
        self.seen.append(tok)

    def forced(self):
        self.done = True
        return [41, 42]


def test_a_request_emits_its_tokens_and_finishes_on_eos_length_stop_text_and_grammar():
    r = request(1, 3, max_tokens=3)
    assert r.accept(5, eos={0}, now=1.0) is None
    assert r.accept(6, eos={0}, now=2.0) is None
    assert r.accept(7, eos={0}, now=3.0) == "length"
    assert r.out == [5, 6, 7] and r.feed[-3:] == [5, 6, 7] and r.stats.generated_tokens == 3
    assert [c.token for c in r.chunks] == [5, 6, 7]

    r = request(2, 3)
    assert r.accept(0, eos={0}, now=1.0) == "stop" and r.out == []  # end of turn: not emitted

    r = request(3, 3, stop=["<9>"])
    assert r.accept(8, eos={0}, now=1.0) is None
    assert r.accept(9, eos={0}, now=2.0) == "stop"
    r.close("stop")
    assert "".join(r.text) == "<8>" and r.stats.finish_reason == "stop"

    c = FakeConstraint()
    r = request(4, 3, constraint=c)
    assert r.accept(40, eos={0}, now=1.0) == "stop"  # the grammar forced the rest and is complete
    assert r.out == [40, 41, 42] and r.stats.forced_tokens == 2 and c.seen == [40]


def test_each_request_keeps_its_own_stats():
    a, b = request(1, 3), request(2, 5)
    a.accept(5, eos={0}, now=a.submitted + 1)
    b.accept(6, eos={0}, now=b.submitted + 2)
    a.close("length")
    assert a.stats is not b.stats
    assert (a.stats.prompt_tokens, b.stats.prompt_tokens) == (3, 5)
    assert a.stats.finish_reason == "length" and b.stats.finish_reason == "length" and b.state != "done"
