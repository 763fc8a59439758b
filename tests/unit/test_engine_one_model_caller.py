"""Exactly one module runs the model to produce tokens: justfit/engine/runner.py. A source scan (run in CI
with the rest of the suite) fails when any other module of the package calls a model or a model body on
token ids, so a second token loop cannot grow back unnoticed.

Left out, each for a stated reason: justfit/bench/ and justfit/probe/ time the model and mlx-lm directly
(that is what they measure); phaseswap/drafting.py runs a drafter's own small model, which only proposes
tokens that runner.py's verify pass accepts or rejects."""

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "justfit"
RUNNER = PACKAGE / "engine" / "runner.py"
EXEMPT = {PACKAGE / "bench", PACKAGE / "probe", PACKAGE / "phaseswap" / "drafting.py"}
# A model (or its body) called on ids or hidden states: model(...), self.model(...), (body or model)(...),
# inner(...), and kvexec's per-layer loop over a model's layers.
CALL = re.compile(r"(\b(model|body|inner)\s*\(\s*(mx\.|x\b|h\b|ids|y\b|inp|tokens|\w+\[None\]))"
                  r"|(\(\s*body\s+or\s+model\s*\)\s*\()"
                  r"|(\bfor\s+\w+\s*,?\s*\w*\s+in\s+zip\(\s*layers)")


def callers():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == RUNNER or any(path == e or e in path.parents for e in EXEMPT):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if CALL.search(code):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}")
    return found


def test_only_the_runner_calls_the_model_to_produce_tokens():
    assert callers() == []


def test_the_scan_finds_a_model_call_where_there_is_one():
    text = RUNNER.read_text()
    assert CALL.search("    logits = model(mx.array(ids)[None], cache=cache)[:, -1, :]")
    assert CALL.search("            (body or model)(mx.array(ids[done:done + n])[None], cache=cache)")
    assert sum(bool(CALL.search(line.split("#", 1)[0])) for line in text.splitlines()) >= 4
