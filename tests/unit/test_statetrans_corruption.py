"""Damaged page files and manifests: detected by checksum, one warning line, history kept and the
missing K/V recomputed from token ids."""

import pytest

from statetrans_util import PAGE, WORDS, runtime, tiny_model_folder

from justfit.statetrans.manifest import manifest_path, read_manifest


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("tiny"))


def _saved(folder, home):
    rt = runtime(folder, home)
    s = rt.session("hist")
    s.generate(WORDS * 4, max_tokens=5)
    s.close()
    m = read_manifest(home, "hist")
    assert len(m.pages) >= 4
    return m, rt.index.store


def _truncate(p):
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _flip_data(p):
    b = bytearray(p.read_bytes())
    b[-10] ^= 0x10
    p.write_bytes(bytes(b))


def _flip_header(p):
    b = bytearray(p.read_bytes())
    b[40] ^= 0x01
    p.write_bytes(bytes(b))


@pytest.mark.parametrize("damage", [_truncate, _flip_data, _flip_header, lambda p: p.unlink()],
                         ids=["truncated", "bit-flip-data", "bit-flip-header", "missing"])
def test_damaged_page_warns_and_recomputes(folder, tmp_path, capfd, damage):
    home = tmp_path / "home"
    m, store = _saved(folder, home)
    damage(store.path(m.pages[2]["hash"]))
    capfd.readouterr()
    rt = runtime(folder, home)
    s = rt.session("hist")
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "warning" in err[0] and "page 3 of" in err[0] and "recomputing" in err[0]
    assert s.tokens == m.tokens and s.kv_tokens == 2 * PAGE               # history kept, pages 1-2 restored
    g = s.generate("continue", max_tokens=3)
    assert g.stats.reused_tokens == 2 * PAGE and s.tokens[:len(m.tokens)] == m.tokens
    s.close()
    capfd.readouterr()
    again = runtime(folder, home).session("hist")                        # the page was written again
    assert "warning" not in capfd.readouterr().err and again.kv_tokens >= len(m.pages) * PAGE


def test_damaged_manifest_falls_back_to_previous_commit(folder, tmp_path, capfd):
    home = tmp_path / "home"
    rt = runtime(folder, home)
    s = rt.session("two")
    s.generate(WORDS * 2, max_tokens=3)
    first = list(s.tokens)
    s.generate("second", max_tokens=3)
    s.close()
    p = manifest_path(home, "two")
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0x04
    p.write_bytes(bytes(b))
    capfd.readouterr()
    s2 = runtime(folder, home).session("two")
    assert "previous commit" in capfd.readouterr().err
    assert s2.tokens == first


def test_manifest_copied_from_another_session_is_refused_on_open(folder, tmp_path):
    """`cp sessions/hist.json sessions/k2.json`: k2 does not open hist's history (one clear line)."""
    import shutil

    from justfit.errors import UserError

    home = tmp_path / "home"
    _saved(folder, home)
    shutil.copy(manifest_path(home, "hist"), manifest_path(home, "k2"))
    with pytest.raises(UserError, match="it holds session 'hist'.*justfit sessions rm k2"):
        runtime(folder, home).session("k2")
