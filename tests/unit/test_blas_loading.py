"""`import justfit` loads OpenBLAS in-process (no re-exec), so pytest and Python users behave normally."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from justfit.blas import openblas_path, reference_blas_bundled

ROOT = Path(__file__).resolve().parents[2]
needs_openblas = pytest.mark.skipif(not reference_blas_bundled() or openblas_path() is None,
                                    reason="needs MLX's Linux CPU wheel and Debian's OpenBLAS (libopenblas0-pthread)")

DUMMY = '''
from justfit.blas import active_blas

def test_blas():
    import mlx.core as mx
    mx.eval(mx.ones((4, 4)) @ mx.ones((4, 4)))
    print("BLAS=" + active_blas())

def test_fails():
    raise AssertionError("dummy failure")  # the dummy suite must report a real failure

def test_after():
    print("AFTER-RAN")

def test_other():
    print("OTHER-RAN")
'''


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "agents"), os.environ.get("PYTHONPATH", "")]))
    env.pop("LD_PRELOAD", None)
    return dict(env, **extra)


def _pytest(tmp_path, *args):
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_dummy.py").write_text(DUMMY)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args, "test_dummy.py"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)


def test_pytest_reports_failures_and_progress_normally(tmp_path):
    r = _pytest(tmp_path, "-v")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "test session starts" in r.stdout
    assert "test_dummy.py::test_fails FAILED" in r.stdout
    assert "AssertionError: dummy failure" in r.stdout
    assert "1 failed, 3 passed" in r.stdout
    assert "BLAS=" not in r.stdout  # captured output of passing tests stays hidden, as usual


def test_pytest_x_k_s_behave(tmp_path):
    r = _pytest(tmp_path, "-x", "-s", "-k", "not other")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "BLAS=" in r.stdout  # -s: live output
    assert "AFTER-RAN" not in r.stdout and "stopping after 1 failures" in r.stdout  # -x stops
    assert "OTHER-RAN" not in r.stdout and "1 deselected" in r.stdout  # -k selects
    if reference_blas_bundled() and openblas_path():
        assert "BLAS=openblas" in r.stdout  # the tests run on OpenBLAS, loaded in-process


@needs_openblas
def test_import_justfit_loads_openblas_or_warns():
    code = "import justfit, mlx.core as mx; from justfit.blas import active_blas; print(active_blas())"
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "openblas" and "Warning" not in out.stderr
    late = "import mlx.core as mx; import justfit"
    out = subprocess.run([sys.executable, "-W", "always", "-c", late], env=_env(), capture_output=True, text=True, check=True)
    assert "slow reference BLAS" in out.stderr and "import justfit` before `mlx`" in out.stderr
    off = subprocess.run([sys.executable, "-c", late], env=_env(JUSTFIT_OPENBLAS="0"), capture_output=True, text=True, check=True)
    assert "slow reference BLAS" not in off.stderr  # turned off on purpose: no warning


@needs_openblas
def test_a_folder_named_mlx_in_the_working_directory_does_not_hide_the_wheel(tmp_path):
    """Run from an MLX checkout: ./mlx shadows the wheel's path in the `mlx` namespace; OpenBLAS still loads."""
    (tmp_path / "mlx").mkdir()
    code = "import justfit, mlx.core as mx; from justfit.blas import active_blas; print(active_blas())"
    out = subprocess.run([sys.executable, "-c", code], env=_env(), cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "openblas"


SPIN = """
import resource, time
import justfit, mlx.core as mx
a = mx.random.normal((1024, 1024)); mx.eval(a)
for _ in range(3):
    mx.eval(a @ a)  # a GEMM big enough for OpenBLAS's worker threads
r0 = resource.getrusage(resource.RUSAGE_SELF); time.sleep(0.5); r1 = resource.getrusage(resource.RUSAGE_SELF)
print(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
"""


@needs_openblas
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="OpenBLAS starts no worker threads on one core")
def test_openblas_workers_sleep_after_a_call():
    """OpenBLAS workers would spin ~0.1 s after each call, taking the cores parallel attention streams need;
    justfit tells them to sleep at once (a user's own OPENBLAS_THREAD_TIMEOUT wins, here the spinning default)."""
    def cpu_while_asleep(**env) -> float:
        out = subprocess.run([sys.executable, "-c", SPIN], env=_env(**env), capture_output=True, text=True, check=True)
        return float(out.stdout)

    idle = cpu_while_asleep()
    # spinning workers need free cores to show: on a machine busy with other work, try a few times
    spin = max(cpu_while_asleep(OPENBLAS_THREAD_TIMEOUT="28") for _ in range(3))
    assert idle < 0.03 and spin > 0.05, (idle, spin)
