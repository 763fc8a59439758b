"""A wrong-typed value in config.toml is blamed on the file and the key, in one line, before any command
runs (click alone would name a `--flag` the user never passed)."""

import pytest
import typer

from justfit.cli import app
from justfit.errors import UserError
from justfit.userconfig import default_map


@pytest.mark.parametrize("body, blamed", [
    ("[chat]\ntemp = -1\n", "[chat] temp = -1"),
    ('[chat]\nmax_tokens = "five"\n', "[chat] max_tokens = 'five'"),
    ("[agent.run]\nmax_steps = 1.5\n", "[agent.run] max_steps = 1.5"),
])
def test_wrong_typed_value_names_file_and_key(tmp_path, body, blamed):
    path = tmp_path / "config.toml"
    path.write_text(body)
    with pytest.raises(UserError) as e:
        default_map(typer.main.get_command(app), path)
    line = str(e.value)
    assert str(path) in line and blamed in line and "--" not in line and "\n" not in line, line


def test_good_values_pass(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text('[chat]\ntemp = 0.7\nmax_tokens = 256\nstop = ["END"]\njson = true\n[agent.run]\nmax_steps = 12\n')
    assert default_map(typer.main.get_command(app), path)["chat"]["max_tokens"] == 256
