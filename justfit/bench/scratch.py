"""A bench's scratch JUSTFIT_HOME: a fresh temporary home, so a run reuses no prefix, session or page stored
by an earlier run (each run's numbers stand alone) and leaves nothing behind once it is done."""

import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def scratch_home(prefix: str):
    """A temporary home, removed when the block ends; kept when it fails, so its logs can be read."""
    home = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield home
    except BaseException:
        print(f"kept {home} (logs of the failed run)", file=sys.stderr, flush=True)
        raise
    shutil.rmtree(home, ignore_errors=True)
