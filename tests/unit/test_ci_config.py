"""The macOS CI workflow (.github/workflows/macos.yml) is checked as configuration: it parses, runs on an
arm64 Mac runner, and its steps run the README's own install and test commands, `-m metal` included, so
the Metal kernels meet Apple's compiler on the first push to a host with Mac runners."""

import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="pyyaml comes with the dev extra")

ROOT = Path(__file__).resolve().parent.parent.parent
WORKFLOW = ROOT / ".github" / "workflows" / "macos.yml"


def _readme_commands() -> list:
    """The shell lines of the README's fenced bash blocks, comments dropped."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        lines += [line.split(" #")[0].strip() for line in block.splitlines() if line.strip() and not line.startswith("#")]
    return lines


def _steps():
    doc = yaml.safe_load(WORKFLOW.read_text())
    jobs = doc["jobs"]
    assert jobs, "no jobs"
    return doc, [(job, step) for job in jobs.values() for step in job["steps"]]


def test_runs_on_an_arm64_mac():
    doc, _ = _steps()
    runners = [job["runs-on"] for job in doc["jobs"].values()]
    assert runners and all(re.fullmatch(r"macos-(1[4-9]|[2-9]\d)(-xlarge)?|macos-latest", r) for r in runners), runners
    assert {"push", "pull_request"} <= set(doc[True] if True in doc else doc["on"])  # YAML 1.1 reads `on` as True


def test_steps_run_the_readme_install_and_test_commands():
    _, steps = _steps()
    runs = "\n".join(step.get("run", "") for _, step in steps)
    readme = _readme_commands()
    develop = next(c for c in readme if 'pip install -e ".[dev]"' in c)
    assert develop in runs, f"the README's Develop line is not run as is: {develop}"
    install = next(c for c in readme if "pip install . &&" in c)
    assert install.split(" && justfit chat")[0] in runs, "the README's install is not run"
    for command in ("python -m pytest -m metal", "ruff check . && lint-imports"):
        assert command in readme and command in runs, command
