"""Shared fixtures: the real default model is fetched and converted once per test home."""

import os
import sys
from pathlib import Path

import pytest

import justfit  # (loads OpenBLAS before any test imports MLX: see justfit/blas.py)


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
def shallow_model_dir(default_model_dir, tmp_path_factory) -> Path:
    """The default model's folder cut to its first 10 of 30 layers (config and weights): the same tokenizer,
    embedding and head, 3x shorter forward passes, for tests of mechanisms that work per step, per request
    or per page alike at any depth (scheduling, sessions, batching)."""
    import json
    import shutil

    import mlx.core as mx

    out = tmp_path_factory.mktemp("models") / "SmolLM2-10-layers"
    out.mkdir()
    config = json.loads((default_model_dir / "config.json").read_text())
    config["num_hidden_layers"] = 10
    (out / "config.json").write_text(json.dumps(config))
    for f in default_model_dir.iterdir():
        if f.suffix == ".safetensors":
            kept = {k: v for k, v in mx.load(str(f)).items()
                    if not k.startswith("model.layers.") or int(k.split(".")[2]) < 10}
            mx.save_safetensors(str(out / f.name), kept, metadata={"format": "mlx"})
        elif f.is_file() and f.name != "config.json":
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="session")
def runtime16(default_model_dir, tmp_path_factory):
    """The real default model with a full-precision KV cache (the exactness reference), over a store of its
    own (the suite runs in several worker processes: pytest-xdist)."""
    return justfit.Runtime(model=str(default_model_dir), kv=justfit.KVConfig(bits=16),
                           home=tmp_path_factory.mktemp("runtime16-home"))


@pytest.fixture
def shallow(runtime16):
    """runtime16 with its model cut to the first 6 of its 30 layers for one test (restored after it): for
    tests of paths that run per layer or per step the same way at any depth, whose prefills the cut makes 5x
    shorter. Only for code that builds its own caches (the runtime's prefix index keeps 30 layers)."""
    inner = runtime16.model.model
    layers = inner.layers
    inner.layers = layers[:6]
    yield runtime16
    inner.layers = layers


@pytest.fixture(scope="session")
def serve_runtime(default_model_dir, tmp_path_factory):
    """The default model as `justfit serve` builds it (4-bit affine KV), over a home of its own: the
    in-process server tests share it (server_support.InProcess) instead of starting one process each."""
    kv = justfit.KVConfig(bits=4, format="affine")
    return justfit.Runtime(model=str(default_model_dir), kv=kv, home=tmp_path_factory.mktemp("serve-home"))


@pytest.fixture(scope="module")
def server(serve_runtime):
    """The app in this process over the session's serve Runtime, one per test module (a module that needs
    other server options, or a real process, defines its own `server`)."""
    from tests.server_support import InProcess

    s = InProcess(serve_runtime)
    yield s
    s.stop()
