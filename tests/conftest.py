"""Shared fixtures: the real default model is fetched and converted once per test home."""

import os
import sys
from pathlib import Path

import pytest

from justfit.blas import maybe_reexec



def pytest_configure(config):
    """Re-run the suite with the BLAS the CLI uses (OpenBLAS preloaded where available: ~16x
    faster prefill); output capture is suspended first so the new process writes to the terminal."""
    if Path(sys.argv[0]).name not in ("pytest", "py.test", "__main__.py"):
        return
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.suspend_global_capture(in_=True)
    maybe_reexec(sys.argv, module="pytest")
    if capman is not None:
        capman.resume_global_capture()

# Test helper modules (statetrans_util, gguf_writer, ...) import by bare name from this folder.
sys.path.insert(0, str(Path(__file__).parent))
# justfit_agents lives in agents/; `pip install -e .` makes it importable, a bare checkout needs this.
sys.path.insert(1, str(Path(__file__).parent.parent / "agents"))

TEST_HOME = Path(os.environ.get("JUSTFIT_TEST_HOME", Path.home() / ".cache" / "justfit-tests"))


@pytest.fixture(scope="session")
def test_home() -> Path:
    """A JUSTFIT_HOME shared by the session's tests, so the default model converts once."""
    TEST_HOME.mkdir(parents=True, exist_ok=True)
    return TEST_HOME


@pytest.fixture(scope="session")
def default_model_dir(test_home) -> Path:
    from justfit.models import default_model

    return default_model(test_home)


@pytest.fixture(scope="session")
def runtime16(default_model_dir, test_home):
    """The real default model with a full-precision KV cache (the exactness reference)."""
    import justfit

    return justfit.Runtime(model=str(default_model_dir), kv=justfit.KVConfig(bits=16), home=test_home)
