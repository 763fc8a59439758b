"""How a Runtime uses PhaseSwap: build its residency manager and its drafter (returned, not attached)."""

from pathlib import Path
from typing import Optional

from ..config import switched_off
from .budget import Budget
from .components import model_components
from .drafting import DraftModel, Gate, PromptLookup, load_draft_model
from .residency import Residency


def spill_root(home: Path) -> Optional[Path]:
    """Where released weights are kept as loaded (JUSTFIT_WEIGHT_SPILL=0 turns the copy off)."""
    return None if switched_off("JUSTFIT_WEIGHT_SPILL") else Path(home) / "spill"


def build_residency(model, memory_budget: Optional[int], home: Path) -> Residency:
    """A residency manager over the model's components, in the idle phase; refuses a model that does not
    fit the budget (MemoryBudgetError) before anything else is allocated."""
    residency = Residency(Budget(memory_budget))
    residency.add_all(model_components(model, spill_root=spill_root(home)))
    residency.enter("idle")
    resident = residency.resident_bytes()
    if memory_budget is not None and resident > memory_budget:
        needed = {c.name: c.size() for c in residency.components.values()}
        residency.budget.refuse("load", needed, resident, 0, 0)
    return residency


def make_drafter(residency: Residency, tokenizer, home: Path, draft_model=None, drafter: str = "prompt-lookup"):
    """(drafter, gate): a draft model (spec or model object, registered as a component) or prompt lookup."""
    if draft_model is not None:
        dm = draft_model if not isinstance(draft_model, str) else load_draft_model(draft_model, tokenizer, home)
        comp = model_components(dm, prefix="draft/", kind_override="draft-model", roles_override=("drafter",),
                                spill_root=spill_root(home))
        residency.add_all(comp)
        return DraftModel(dm, comp[0].name), Gate()
    return (PromptLookup() if drafter == "prompt-lookup" else None), Gate()
