"""OpenBLAS preload changes speed, not answers: same greedy tokens, logits within tolerance."""

import json
import os
import subprocess
import sys

import pytest

from justfit.blas import openblas_path, reference_blas_bundled

SCRIPT = """
import json, sys
import justfit
import mlx.core as mx
from justfit.blas import active_blas
from mlx_lm.models.cache import make_prompt_cache
from justfit.models import load
model, tok = load(sys.argv[1])
ids = tok.encode("The quick brown fox jumps over the lazy dog. In Paris,")
cache = make_prompt_cache(model)
logits = model(mx.array([ids]), cache=cache)[0, -1]
toks = [int(mx.argmax(logits))]
for _ in range(7):
    toks.append(int(mx.argmax(model(mx.array([toks[-1:]]), cache=cache)[0, -1])))
print(json.dumps({"blas": active_blas(), "tokens": toks, "logits": logits.tolist()}))
"""


@pytest.mark.skipif(not reference_blas_bundled() or openblas_path() is None,
                    reason="needs MLX's Linux CPU wheel and Debian's OpenBLAS (libopenblas0-pthread)")
def test_same_greedy_tokens_with_and_without_openblas(default_model_dir):
    runs = {}
    for fast in (True, False):  # `import justfit` loads OpenBLAS in-process unless JUSTFIT_OPENBLAS=0
        env = dict(os.environ, JUSTFIT_OPENBLAS="1" if fast else "0", LD_PRELOAD="")
        out = subprocess.run([sys.executable, "-c", SCRIPT, str(default_model_dir)], env=env,
                             capture_output=True, text=True, check=True).stdout
        runs[fast] = json.loads(out.strip().splitlines()[-1])
    fast, slow = runs[True], runs[False]
    assert fast["blas"] == "openblas" and slow["blas"].startswith("reference")
    assert fast["tokens"] == slow["tokens"]
    diff = max(abs(a - b) for a, b in zip(fast["logits"], slow["logits"]))
    assert diff < 1e-3, f"logits differ by {diff}"  # fp32 summation order only
