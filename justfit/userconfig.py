"""The user's config file, `$JUSTFIT_HOME/config.toml`: defaults for command options.

One table per command, keys named like the option without dashes (`max_tokens`, `repetition_penalty`):

    [chat]
    temp = 0.7
    max_tokens = 256

    [agent.run]
    max_steps = 8

Precedence, highest first: command-line flags > environment variables (JUSTFIT_MODEL,
JUSTFIT_MEMORY_BUDGET) > this file > built-in defaults. It is click's own order: the file becomes the
command's `default_map`, so flags and environment variables still win.
"""

import sys
from pathlib import Path
from typing import Optional

from .config import home
from .errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib


def config_path(root: Optional[Path] = None) -> Path:
    return home(root) / "config.toml"


def read_config(path: Optional[Path] = None) -> dict:
    """The parsed config file, {} when there is none; a one-line UserError when it is not valid TOML."""
    path = path or config_path()
    try:
        text = path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):
        return {}  # no file (or no home yet): the command itself reports a bad JUSTFIT_HOME
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path} is not valid TOML: {e}") from None


def check_against(command, table: dict, where: str, path: Path) -> None:
    """Every key names a subcommand or an option of `command` (a click command), so typos are errors."""
    subcommands = getattr(command, "commands", None) or {}  # a group (typer bundles its own click)
    options = {p.name: p for p in command.params}
    for key, value in table.items():
        if key in subcommands and isinstance(value, dict):
            check_against(subcommands[key], value, f"{where}.{key}" if where else key, path)
        elif key not in options or isinstance(value, dict):
            known = sorted(set(options) | set(subcommands))
            label = f"[{where}] has no option" if where else "no command or option named"
            raise UserError(f"{path}: {label} {key!r} (known: {', '.join(known) or 'none'})")
        else:
            _check_value(command, options[key], value, f"[{where}] {key}" if where else key, path)


def _check_value(command, param, value, label: str, path: Path) -> None:
    """The value converts as the option's own type would convert it from the command line; a wrong one is
    blamed on the file and the key (click alone would name a flag the user never passed)."""
    try:
        runtime = getattr(param, "get_runtime_param", None)  # typer's options convert through it
        if runtime is not None:
            runtime().coerce(value, param=param, ctx=command.context_class(command))
        else:
            param.type_cast_value(command.context_class(command), value)
    except Exception as e:  # click's BadParameter, from the click that typer bundles
        raise UserError(f"{path}: {label} = {value!r}: {getattr(e, 'message', e)}") from None


def default_map(command, path: Optional[Path] = None) -> dict:
    """The config file as click's default_map for `command` (the root group), checked against it."""
    path = path or config_path()
    table = read_config(path)
    check_against(command, table, "", path)
    return table
