"""Bad input gets one line on stderr and exit code 2, never a traceback."""

import os
import subprocess
import sys


def _run(args, home, extra_env=None):
    env = dict(os.environ, JUSTFIT_HOME=str(home), **(extra_env or {}))
    return subprocess.run([sys.executable, "-m", "justfit", *args], env=env, capture_output=True,
                          text=True, timeout=300)


def _assert_user_error(r, *words):
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("justfit: error:"), r.stderr
    for w in words:
        assert w in line, line


def test_missing_path(tmp_path):
    _assert_user_error(_run(["chat", "--prompt", "x", "--model", str(tmp_path / "nope.gguf")], tmp_path), "nope.gguf")


def test_directory_that_is_not_a_model(tmp_path):
    (tmp_path / "empty").mkdir()
    _assert_user_error(_run(["chat", "--prompt", "x", "--model", str(tmp_path / "empty")], tmp_path),
                       "not a model folder")


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 10)
    _assert_user_error(_run(["models", "import", str(bad)], tmp_path), "GGUF")


def test_truncated_gguf(tmp_path):
    from tests.gguf_writer import write_tiny_llama_gguf

    src = tmp_path / "full.gguf"
    write_tiny_llama_gguf(src, tensor_type="Q4_0")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    _assert_user_error(_run(["models", "import", str(cut)], tmp_path), "truncated")


def test_unsupported_tensor_type_is_named(tmp_path):
    from tests.gguf_writer import write_tiny_llama_gguf

    f = tmp_path / "k.gguf"
    write_tiny_llama_gguf(f, tensor_type="Q5_0")
    _assert_user_error(_run(["models", "import", str(f)], tmp_path), "Q5_0")


def test_unsupported_architecture_is_named(tmp_path):
    from tests.gguf_writer import write_tiny_llama_gguf

    f = tmp_path / "arch.gguf"
    write_tiny_llama_gguf(f, tensor_type="F32", architecture="mamba")
    _assert_user_error(_run(["models", "import", str(f)], tmp_path), "mamba")


def test_no_network_when_default_not_cached(tmp_path):
    offline = {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
               "PIP_EXTRA_INDEX_URL": "", "PIP_FIND_LINKS": "", "PIP_RETRIES": "0", "PIP_TIMEOUT": "2",
               "PIP_NO_CACHE_DIR": "1"}
    r = _run(["chat", "--prompt", "x"], tmp_path / "home", offline)
    _assert_user_error(r, "could not download", "--model")


def test_unwritable_home(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file, not a folder")
    r = _run(["chat", "--prompt", "x"], blocker / "home")
    _assert_user_error(r, "JUSTFIT_HOME", "not writable")


def test_bad_option_value_is_a_usage_error(tmp_path):
    r = _run(["chat", "--kv-bits", "3", "--prompt", "x"], tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
