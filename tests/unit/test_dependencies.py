"""Dependencies stay within the ranges pyproject declares as tested; an untested mlx-lm fails loudly."""

import sys
from importlib.metadata import version
from pathlib import Path

from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

PYPROJECT = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())


def _requirement(name: str) -> Requirement:
    reqs = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    return next(r for r in reqs if r.name == name)


def test_installed_mlx_lm_is_in_the_tested_range():
    req = _requirement("mlx-lm")
    installed = version("mlx-lm")
    assert req.specifier and "<" in str(req.specifier), f"mlx-lm must have an upper bound, not {req}"
    assert req.specifier.contains(installed), (
        f"installed mlx-lm {installed} is outside the tested range {req.specifier}: justfit subclasses mlx-lm's "
        "private _BaseCache; run the suite on this version, then widen the pin in pyproject.toml")


def test_no_unused_heavy_dependency():
    names = {Requirement(r).name for r in PYPROJECT["project"]["dependencies"]}
    assert "matplotlib" not in names  # the [plot] extra
    assert "sentencepiece" not in names  # GGUF vocabularies are rebuilt with `tokenizers`
    assert "matplotlib>=3.7" in PYPROJECT["project"]["optional-dependencies"]["plot"]
