"""Memory budget: a byte limit (or a fraction of physical RAM) plus a live check of available memory.

A phase may start only if (a) the bytes resident after loading what it needs, plus its workspace,
stay within the budget, and (b) the bytes it must newly allocate fit in the system's available
memory minus a reserve, so loading never pushes the machine into swap or the OOM killer. Otherwise
`MemoryBudgetError` names what was needed and what was available.
"""

import os
import re
from typing import Optional, Union

from ..errors import MemoryBudgetError, UserError

RESERVE_BYTES = 256 << 20  # kept free for the OS and the tools the agent runs
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def physical_memory() -> int:
    import psutil

    return psutil.virtual_memory().total


def available_memory() -> int:
    """Bytes the system can give now without swapping (psutil 'available')."""
    import psutil

    return psutil.virtual_memory().available


def parse_budget(value: Union[None, int, float, str]) -> Optional[int]:
    """Bytes (int), a fraction of physical RAM (0 < float <= 1), or text like '4GB', '512MiB', '50%'."""
    if value is None:
        return None
    if isinstance(value, str):
        s = value.strip().lower()
        m = re.fullmatch(r"([0-9.]+)\s*(%|[kmg]i?b|b)?", s)
        if not m:
            raise UserError(f"memory budget {value!r} is not bytes, a fraction or a size like '4GB' or '50%'")
        num, unit = float(m.group(1)), m.group(2) or ""
        value = num / 100 if unit == "%" else int(num * _UNITS[unit]) if unit else (num if "." in m.group(1) else int(num))
    if isinstance(value, bool):
        raise UserError(f"memory budget must be bytes or a fraction, not {value!r}")
    if isinstance(value, float) and 0 < value <= 1:
        return int(value * physical_memory())
    if isinstance(value, int) and value > 0:
        return value
    raise UserError(f"memory budget must be bytes > 0 or a fraction in (0, 1], not {value!r}")


def budget_from_env() -> Optional[int]:
    """The default budget: $JUSTFIT_MEMORY_BUDGET (same syntax as parse_budget), else none."""
    return parse_budget(os.environ.get("JUSTFIT_MEMORY_BUDGET"))


def mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


class Budget:
    """Checks a phase's need against the byte limit (if any) and the live available memory."""

    def __init__(self, limit: Optional[int] = None, reserve: int = RESERVE_BYTES):
        self.limit, self.reserve = limit, reserve

    def shortfall(self, resident: int, new_bytes: int, workspace: int) -> int:
        """Bytes that must be freed before the phase fits (0 when it fits)."""
        short = 0
        if self.limit is not None:
            short = max(short, resident + new_bytes + workspace - self.limit)
        short = max(short, new_bytes + workspace - (available_memory() - self.reserve))
        return short

    def refuse(self, phase: str, needed: dict, resident: int, new_bytes: int, workspace: int):
        """Raise the MemoryBudgetError that says what the phase needed and what was available."""
        parts = ", ".join(f"{k} {mb(v)}" for k, v in needed.items()) or "nothing"
        limit = f"budget {mb(self.limit)}" if self.limit is not None else "no byte budget"
        raise MemoryBudgetError(
            f"phase {phase!r} needs {mb(sum(needed.values()) + workspace)} ({parts}; workspace {mb(workspace)}), "
            f"{mb(new_bytes + workspace)} of it not yet resident; available: {limit}, {mb(resident)} held by "
            f"components that cannot be evicted, system available {mb(available_memory())} "
            f"(reserve {mb(self.reserve)})"
        )

    def describe(self) -> str:
        """One line for `justfit info` and residency reports."""
        avail = f"system available {mb(available_memory())}, reserve {mb(self.reserve)}"
        if self.limit is None:
            return f"none (live check only: {avail})"
        return f"{mb(self.limit)} ({self.limit / physical_memory():.0%} of RAM; {avail})"
