"""`python -m justfit.probe ...`: the probe command on its own (same options as `justfit probe`)."""

import sys

import typer

from ..errors import UserError
from .cli import probe

if __name__ == "__main__":
    try:
        typer.run(probe)
    except UserError as e:
        print(f"justfit: error: {e}", file=sys.stderr)
        sys.exit(2)
