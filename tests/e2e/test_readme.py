"""Every fenced code block a user would run in README.md, docs/*.md and agents/README.md runs here, as the
user would run it: Python blocks in a fresh interpreter, shell blocks in bash, TOML blocks as the config
file, and the blocks that talk to `justfit serve` against one real server started the README's way.

A block that cannot run here says why in the Markdown itself, in an HTML comment on the line before it:

    <!-- test: skip: installs into a fresh venv; .github/workflows/macos.yml runs it -->

Other markers: `<!-- test: server -->` (runs against the server; `127.0.0.1:8000` becomes its port) and
`needs MODULE` (skipped, with the pip name, where an optional package is missing), joined with `;`.
A fence without a language is a diagram, not code: it is not run.
"""

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.server_support import Served

ROOT = Path(__file__).resolve().parent.parent.parent
FILES = ["README.md", "agents/README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
RUNS = {"bash", "python", "toml"}
MARKER = re.compile(r"^<!--\s*test:\s*(.*?)\s*-->\s*$")
PIP = {"agents": "openai-agents", "langchain_openai": "langchain-openai", "openai": "openai"}


@dataclass
class Block:
    path: str
    line: int
    lang: str
    code: str
    marks: list = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"

    def skip_reason(self):
        for m in self.marks:
            if m.startswith("skip"):
                return m.partition(":")[2].strip() or None
        return None


def blocks(path: str):
    """The fenced blocks of one Markdown file, each with the markers of the comment line before it."""
    lines = (ROOT / path).read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        fence = re.match(r"^(```+)(\S*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and lines[i].strip() != fence.group(1):
            body.append(lines[i])
            i += 1
        i += 1
        before = MARKER.match(lines[start - 1]) if start else None
        text = before.group(1) if before else ""
        marks = [text] if text.startswith("skip") else [m.strip() for m in text.split(";") if m.strip()]
        out.append(Block(path, start + 1, fence.group(2).lower(), "\n".join(body) + "\n", marks))
    return out


ALL = [b for f in FILES for b in blocks(f)]
CODE = [b for b in ALL if b.lang]


def test_every_block_runs_or_says_why():
    """Each block with a language is one this test runs, or is marked with the reason it cannot run here."""
    unknown = [b.id for b in CODE if b.lang not in RUNS and not b.skip_reason()]
    assert not unknown, f"blocks in a language this test does not run, with no skip reason: {unknown}"
    bare = [b.id for b in CODE if any(m == "skip" for m in b.marks)]
    assert not bare, f"skip markers without a reason: {bare}"
    runnable = [b for b in CODE if not b.skip_reason()]
    assert len(runnable) >= 8, [b.id for b in runnable]  # the README's own runnable blocks are most of them
    print(f"{len(runnable)} runnable blocks of {len(CODE)}:", ", ".join(b.id for b in runnable))


@pytest.fixture(scope="module")
def home(test_home, default_model_dir, tmp_path_factory) -> Path:
    """A home of the blocks' own (their sessions and logs stay out of the suite's), with the suite's
    converted models and built kernels linked in, as a user's home has them after the first run."""
    h = tmp_path_factory.mktemp("readme-home")
    for sub in ("models", "kernels"):
        if (test_home / sub).exists():
            (h / sub).symlink_to(test_home / sub, target_is_directory=True)
    return h


@pytest.fixture(scope="module")
def env(home):
    """What a user's shell has after `pip install .`: justfit and justfit_agents importable, the console
    script on PATH."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    pythonpath = os.pathsep.join([str(ROOT), str(ROOT / "agents"), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, JUSTFIT_HOME=str(home), PATH=path, PYTHONPATH=pythonpath)


@pytest.fixture(scope="module")
def server(home):
    s = Served(home, "default")
    yield s
    s.stop()


def _needs(block: Block):
    for m in block.marks:
        if m.startswith("needs "):
            module = m.split()[1]
            if importlib.util.find_spec(module) is None:
                pytest.skip(f"pip install {PIP.get(module, module)}")


def _run(argv, block: Block, env: dict, cwd: Path, timeout: float = 300):
    r = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{block.id} ({block.lang}) exited {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.mark.parametrize("block", [b for b in CODE if "server" not in b.marks], ids=lambda b: b.id)
def test_block(block, env, tmp_path):
    if block.skip_reason():
        pytest.skip(block.skip_reason())
    _needs(block)
    if block.lang == "toml":
        _config(block, tmp_path)
    elif block.lang == "python":
        _run([sys.executable, "-c", block.code], block, env, tmp_path)
    else:
        _run(["bash", "-euo", "pipefail", "-c", block.code], block, env, tmp_path)


def _config(block: Block, tmp_path: Path):
    """A TOML block is a config file: it must be one `justfit` accepts, every key and value checked."""
    import typer

    from justfit.cli import app
    from justfit.userconfig import default_map

    path = tmp_path / "config.toml"
    path.write_text(block.code)
    assert default_map(typer.main.get_command(app), path)


@pytest.mark.parametrize("block", [b for b in CODE if "server" in b.marks], ids=lambda b: b.id)
def test_server_block(block, server, env, tmp_path):
    if block.skip_reason():
        pytest.skip(block.skip_reason())
    _needs(block)
    code = block.code.replace("http://127.0.0.1:8000", server.url)
    r = _run([sys.executable, "-c", code], block, env, tmp_path)
    assert r.stdout.strip(), f"{block.id} printed nothing"
