"""The serve benches' scratch homes: each round's servers write a store of the model's pages (~170 MB for the
default model), so the home goes once the round is done, and stays, named, when it fails."""

import pytest

from justfit.bench.scratch import scratch_home


def test_a_finished_rounds_home_is_removed():
    with scratch_home("justfit-test-home-") as home:
        (home / "store").mkdir()
        (home / "store" / "page").write_bytes(b"x" * 1024)
    assert not home.exists()


def test_a_failed_rounds_home_is_kept_and_named(capsys):
    with pytest.raises(RuntimeError):
        with scratch_home("justfit-test-home-") as home:
            (home / "justfit-serve.log").write_text("justfit: internal error\n")
            raise RuntimeError("justfit-serve exited with 1")
    try:
        assert (home / "justfit-serve.log").exists()
        assert str(home) in capsys.readouterr().err
    finally:
        import shutil

        shutil.rmtree(home)


def test_a_server_that_exits_at_start_is_reported_with_its_last_log_line(tmp_path):
    from justfit.bench.serve_trace import Server

    with pytest.raises(RuntimeError) as e:
        Server("justfit-serve", str(tmp_path / "no-such-model"), tmp_path)
    assert "exited with" in str(e.value) and "(log: " in str(e.value) and "no-such-model" in str(e.value), e.value
