"""PhaseSwap: keep only what the current phase needs resident, under a memory budget.

components.py  named components (embedding, LM head, layer groups, draft model, adapters, KV) + reload
leases.py      named idempotent leases with dependencies
budget.py      byte / fraction budget and the live available-memory check
residency.py   the manager: phases, eviction order, residency() report
kvspill.py     KV of a bare cache list as a spillable component
toolphase.py   release everything during a tool call, prefetch on exit
drafting.py    prompt-lookup and draft-model drafters, the on/off gate
attach.py      builds a Runtime's residency manager and drafter (the token loops are in justfit/engine)
"""

from .budget import Budget, parse_budget
from .components import Component
from .leases import Leases
from .residency import PHASES, Residency

__all__ = ["Budget", "Component", "Leases", "PHASES", "Residency", "parse_budget"]
