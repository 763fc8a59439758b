"""Every JUSTFIT_* on/off switch reads the same words (config.switched_off): before, some took only "0"."""

import pytest

from justfit import blas
from justfit.kvexec import cpu
from justfit.models import layout, tuning
from justfit.phaseswap.attach import spill_root

OFF_WORDS = ["0", "off", "OFF", " no ", "False"]
ON_WORDS = [None, "1", "on", "yes"]
SWITCHES = {
    "JUSTFIT_ROW_MAJOR": lambda: not layout.enabled(),
    "JUSTFIT_CPU_KERNELS": cpu.switched_off,
    "JUSTFIT_WEIGHT_SPILL": lambda: spill_root("/home") is None,
}


def _set(monkeypatch, name, word):
    if word is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, word)


@pytest.mark.parametrize("name", sorted(SWITCHES))
@pytest.mark.parametrize("word", OFF_WORDS + ON_WORDS)
def test_a_switch_is_off_exactly_for_the_off_words(monkeypatch, name, word):
    monkeypatch.setitem(tuning.choices(), "row_major", True)  # the layout where measured faster: here, the switch alone
    _set(monkeypatch, name, word)
    assert SWITCHES[name]() is (word in OFF_WORDS)


@pytest.mark.parametrize("word", OFF_WORDS)
def test_openblas_is_not_preloaded_when_switched_off(monkeypatch, word):
    monkeypatch.setenv("JUSTFIT_OPENBLAS", word)
    assert blas.openblas_path() is None


@pytest.mark.parametrize("word", ["1", "ON", " yes ", "True"])
def test_openblas_on_words_in_any_case_find_the_library(monkeypatch, word):
    monkeypatch.delenv("JUSTFIT_OPENBLAS", raising=False)
    found = blas.openblas_path()
    if found is None:
        pytest.skip("no OpenBLAS libblas is installed on this machine")
    monkeypatch.setenv("JUSTFIT_OPENBLAS", word)  # before: "ON" was taken for a path, and OpenBLAS was off
    assert blas.openblas_path() == found
