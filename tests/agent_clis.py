"""The real agent CLIs the API tests drive (Codex CLI, Claude Code), installed from npm by `.ci/run` into
`.ci/npm` where `node` exists. Tests that need one skip with the reason when it is not there."""

import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NPM_BIN = ROOT / ".ci" / "npm" / "node_modules" / ".bin"
PACKAGES = {"codex": "@openai/codex@0.171.0", "claude": "@anthropic-ai/claude-code@2.1.197"}  # as .ci/run pins them


def find_cli(name: str) -> str:
    """The path of agent CLI `name` ('codex' or 'claude'): JUSTFIT_AGENT_CLI_DIR, then .ci/npm, then PATH;
    skips the calling test (with how to install it) when none has it."""
    for folder in filter(None, [os.environ.get("JUSTFIT_AGENT_CLI_DIR"), str(NPM_BIN)]):
        path = Path(folder) / name
        if path.exists():
            return str(path)
    found = shutil.which(name)
    if found:
        return found
    how = f"npm install --prefix .ci/npm {PACKAGES[name]}" if shutil.which("npm") else "node and npm are not installed"
    pytest.skip(f"the {name} CLI is not installed ({how})")
