"""Helpers for the StateTrans tests: one tiny random-weight model folder (with a ChatML tokenizer)
converted once, and Runtimes over a fresh home per test."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = 32


def tiny_model_folder(cache_dir: Path, layers: int = 2, context: int = 2048) -> Path:
    """Write and convert a tiny Llama GGUF once (`context`: its trained context, which bounds prompt +
    max_tokens); returns the mlx-lm folder."""
    from gguf_writer import write_tiny_llama_gguf

    from justfit.models import import_gguf

    cache_dir.mkdir(parents=True, exist_ok=True)
    gguf = cache_dir / f"tiny-st-{layers}-{context}.gguf"
    if not gguf.exists():
        write_tiny_llama_gguf(gguf, "F32", layers=layers, context=context)
    return import_gguf(gguf, home=cache_dir / "home", log=lambda m: None)


def runtime(folder: Path, home: Path, bits: int = 4, page: int = PAGE, fmt: str = "affine", float_pages: int = 1):
    import justfit

    kv = justfit.KVConfig(quantized_kv_start=0, bits=bits, format=fmt, page_size=page, float_pages=float_pages)
    return justfit.Runtime(model=str(folder), kv=kv, home=home)


def run_py(code: str, env_home: Path, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    """Run python code in a fresh process with the worktree and tests importable."""
    import os

    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}", JUSTFIT_HOME=str(env_home))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=timeout, **kw)


WORDS = "the quick brown fox jumps over the lazy dog and the sun is shining on the river bank today "
