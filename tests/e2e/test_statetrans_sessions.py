"""StateTrans sessions on a tiny random-weight model: turns, prefix reuse, fork sharing, rewind,
restore after restart, refusals, name sanitizing, read-only store / disk full."""

import errno
import json
import os

import pytest

from statetrans_util import PAGE, WORDS, run_py, runtime, tiny_model_folder

from justfit.errors import UserError
from justfit.statetrans.manifest import read_manifest, write_manifest


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def home(tmp_path):
    return tmp_path / "home"


@pytest.fixture
def rt(folder, home):
    return runtime(folder, home)


def test_turns_append_history_and_reuse_it(rt):
    s = rt.session("agent")
    g1 = s.generate(WORDS * 3, max_tokens=6)
    first, kv1 = list(s.tokens), s.kv_tokens
    assert g1.stats.reused_tokens == 0 and kv1 > 0.9 * len(first)
    g2 = s.generate("and then what happened", max_tokens=6)
    assert s.tokens[:len(first)] == first                      # the turn was appended, not re-rendered
    assert g2.stats.reused_tokens == kv1                     # nothing of turn 1 was prefilled again
    assert g2.stats.prompt_tokens - g2.stats.reused_tokens < 0.25 * g2.stats.prompt_tokens
    assert [m["role"] for m in s.messages] == ["user", "assistant", "user", "assistant"]
    assert g2.stats.checkpoint_s >= 0 and g2.stats.history_tokens == len(s.tokens)


def test_plain_generate_reuses_longest_cached_prefix(rt, folder, home):
    prompt = WORDS * 4
    a = rt.generate(prompt, max_tokens=3)
    n = a.stats.prompt_tokens
    b = rt.generate(prompt, max_tokens=3)
    assert a.stats.reused_tokens == 0
    assert b.stats.reused_tokens == n - 1                                # token-exact: all but the last token
    assert b.tokens == a.tokens
    edited = prompt + " but a different ending"
    same = next(i for i, (x, y) in enumerate(zip(rt.encode(prompt), rt.encode(edited))) if x != y)
    c = rt.generate(edited, max_tokens=3)                                # shares every token before the edit
    assert c.stats.reused_tokens == same > n - 20
    fresh = runtime(folder, home)  # new pool: sealed pages come from disk (plain requests keep open pages in memory)
    d = fresh.generate(prompt, max_tokens=3)
    assert d.stats.reused_tokens == (n - 1) // PAGE * PAGE > 0 and d.tokens == a.tokens


def test_session_reuses_prefix_of_another_session(rt):
    system = [{"role": "system", "content": WORDS * 3}]
    a = rt.session("a")
    a.generate(system + [{"role": "user", "content": "task one"}], max_tokens=3)
    b = rt.session("b")
    g = b.generate(system + [{"role": "user", "content": "task two"}], max_tokens=3)
    assert g.stats.reused_tokens >= PAGE * 3


def test_fork_shares_pages_without_copying(rt):
    s = rt.session("parent")
    s.generate(WORDS * 4, max_tokens=5)
    pool = rt.index.pool
    before = pool.nbytes
    c = s.fork("child")
    assert pool.nbytes == before                                        # no KV bytes for the fork itself
    sealed = s.kv_tokens // PAGE
    assert c.seq.table[:sealed] == s.seq.table[:sealed]
    c.generate("child task", max_tokens=4)
    new_tokens = c.kv_tokens - s.kv_tokens
    cache = c.cache[0]
    page_bytes = len(c.cache) * 2 * cache.n_kv_heads * PAGE * cache.head_dim * 4   # one open fp32 page
    grown = pool.nbytes - before
    assert 0 < grown <= (-(-new_tokens // PAGE) + 1) * page_bytes       # new tokens + the COW partial page
    assert c.seq.table[:sealed] == s.seq.table[:sealed]                  # still the parent's pages
    kv = s.kv_tokens
    g = s.generate("parent goes on", max_tokens=3)                       # parent unaffected by the child
    assert g.stats.reused_tokens == kv
    with pytest.raises(UserError, match="already exists"):
        s.fork("child")


def test_rewind_drops_tokens_and_kv(rt):
    s = rt.session("r")
    s.generate(WORDS * 3, max_tokens=6)
    before = list(s.tokens)
    s.rewind(40)
    assert s.tokens == before[:-40] and s.kv_tokens <= len(s.tokens)
    assert all(m["end"] <= len(s.tokens) for m in s.messages)
    g = s.generate(before[-40:-30], max_tokens=3)                        # raw token ids append as is
    assert s.tokens[:len(before) - 30] == before[:-30]
    assert g.stats.reused_tokens == len(before) - 40
    with pytest.raises(UserError):
        s.rewind(10 ** 6)


RESTART = """
import json, sys
from statetrans_util import runtime
rt = runtime(sys.argv[1] if len(sys.argv) > 1 else {folder!r}, {home!r})
s = rt.session("keep")
print("RESTORED", s.kv_tokens, len(s.tokens))
g = s.generate("second question about the fox", max_tokens=8)
print("REPLY", json.dumps(g.tokens), g.stats.reused_tokens)
"""


def test_restore_after_restart_gives_identical_greedy_continuation(rt, folder, home):
    s = rt.session("keep")
    s.generate(WORDS * 3, max_tokens=6)
    kv_before = s.kv_tokens
    s.close()
    ref = runtime(folder, home).session("ref-src")  # in-process reference: same turns, no restart
    ref.generate(WORDS * 3, max_tokens=6)
    expect = ref.generate("second question about the fox", max_tokens=8).tokens
    out = run_py(RESTART.format(folder=str(folder), home=str(home)), home)
    assert out.returncode == 0, out.stderr
    lines = dict(l.split(" ", 1) for l in out.stdout.splitlines() if l[:1].isupper())
    kv, n = map(int, lines["RESTORED"].split())
    assert n == len(s.tokens) and kv == kv_before > (n // PAGE) * PAGE  # the open page came back too
    reply, reused = lines["REPLY"].rsplit(" ", 1)
    assert json.loads(reply) == expect and int(reused) >= kv
    assert "warning" not in out.stderr


@pytest.mark.parametrize("field,match", [("model_fingerprint", "another model"),
                                         ("tokenizer_fingerprint", "another tokenizer"),
                                         ("kv", "KV format")])
def test_manifest_of_other_model_tokenizer_or_format_is_refused(rt, home, field, match):
    s = rt.session("m")
    s.generate(WORDS, max_tokens=2)
    s.close()
    m = read_manifest(home, "m")
    setattr(m, field, dict(m.kv, name="q4-rotated", format="rotated") if field == "kv" else "0" * 16)
    write_manifest(home, m)
    with pytest.raises(UserError, match=match):
        rt.session("m")


def test_other_kv_config_is_refused(rt, folder, home):
    rt.session("k").close()
    s = rt.session("k2")
    s.generate(WORDS, max_tokens=2)
    s.close()
    with pytest.raises(UserError, match="q8-affine"):
        runtime(folder, home, bits=8).session("k2")


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a\x00b", "", ".hidden", "a/b", "x.prev", "a" * 200, 5])
def test_session_names_are_sanitized(rt, home, name):
    with pytest.raises(UserError, match="invalid session name"):
        rt.session(name)
    assert not (home.parent / "x.json").exists()


def test_disk_full_is_a_clear_error_and_session_continues(rt, monkeypatch, capfd):
    import justfit.statetrans.store as store

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "atomic_write", full)
    s = rt.session("full")
    g1 = s.generate(WORDS * 2, max_tokens=3)
    g2 = s.generate("more", max_tokens=3)
    err = capfd.readouterr().err
    assert err.count("No space left on device") == 1 and "continues in memory" in err
    assert g2.stats.reused_tokens > 0 and g1.stats.disk_bytes_written == 0
    with pytest.raises(UserError, match="No space left"):
        s.checkpoint()
    monkeypatch.undo()
    assert s.checkpoint()["disk_bytes_written"] > 0                      # the store is back: persisted again


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores read-only permissions")
def test_read_only_store(rt, home, capfd):
    home.mkdir(parents=True, exist_ok=True)
    os.chmod(home, 0o555)
    try:
        s = rt.session("ro")
        g = s.generate(WORDS, max_tokens=3)
        assert "cannot write the session store" in capfd.readouterr().err and g.tokens
    finally:
        os.chmod(home, 0o755)


def test_store_blocked_by_a_file_is_a_clear_error(rt, home, capfd):
    """Stands in for a read-only store when tests run as root: writes fail, the session goes on."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "store").write_text("not a folder")
    s = rt.session("blocked")
    g = s.generate(WORDS, max_tokens=3)
    g2 = s.generate("again", max_tokens=3)
    assert "cannot write the session store" in capfd.readouterr().err
    assert g.tokens and g2.stats.reused_tokens > 0
    with pytest.raises(UserError, match="cannot write the session store"):
        s.checkpoint()


def test_a_session_turn_is_an_engine_request_and_one_runs_at_a_time(runtime16):
    """Session.submit queues the turn on the session's own caches (a front steps it beside others); a second
    turn while one runs is refused in one line; when it finishes the session holds the turn, K/V included."""
    s = runtime16.session(None)
    try:
        req = s.submit("Name a color.", 4)
        with pytest.raises(UserError, match="one turn at a time"):
            s.submit("And another?", 4)
        g = req.result()
        start = g.stats.prompt_tokens
        assert g.tokens and s.tokens[start:start + len(g.tokens)] == g.tokens  # then the template's closing tokens
        assert s.kv_tokens == start + len(g.tokens)  # the reply's K/V went in when the caller read its last chunk
        again = s.submit("And another?", 2).result()
        assert again.stats.reused_tokens >= len(s.tokens) - len(again.tokens) - 16  # only the new turn prefilled
    finally:
        s.close()


def test_a_turn_left_after_its_last_chunk_is_recorded_and_the_next_turn_runs(runtime16):
    """A caller that stops iterating at the turn's last chunk (a `break`, or reading only the first token of
    a one-token turn) closes the stream: the turn is recorded then, not at some later engine call, so the
    session's next turn is not refused as 'already running'."""
    s = runtime16.session(None)
    try:
        n = len(s.tokens)
        for chunk in s.stream("Name a color.", max_tokens=1):
            first = chunk.token
            break
        assert s.running is None and s.tokens[n:] and first in s.tokens[n:]
        s.rewind(len(s.tokens) - n)
        assert s.generate("Name a color.", max_tokens=1).tokens == [first]
    finally:
        s.close()
