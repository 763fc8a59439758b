"""Errors a user can cause and fix: the CLI prints them as one line and exits 2."""


class UserError(Exception):
    """Bad input or environment the user can fix (missing file, bad GGUF, no network...)."""


class MemoryBudgetError(UserError):
    """A phase needs more memory than the budget or the machine has available."""
