"""How a Runtime uses PhaseSwap: build its residency manager and drafter, and run its turns phased."""

import os

from .budget import Budget, parse_budget
from .components import Component, model_components
from .drafting import DraftModel, Gate, PromptLookup, load_draft_model
from .residency import Residency


def attach(rt, draft_model=None, drafter: str = "prompt-lookup"):
    """Give `rt` a residency manager (`rt.phaseswap`) over its model's components, check the loaded
    model fits the budget, and set up the drafter: a draft model (spec or model object) or prompt lookup."""
    if rt.memory_budget is None:  # the same default `justfit info` shows
        rt.memory_budget = parse_budget(os.environ.get("JUSTFIT_MEMORY_BUDGET"))
    rt.phaseswap = Residency(Budget(rt.memory_budget))
    spill = None if os.environ.get("JUSTFIT_WEIGHT_SPILL") == "0" else rt.home / "spill"
    rt.phaseswap.add_all(model_components(rt.model, spill_root=spill))
    rt.drafter, rt.gate = None, Gate()
    if draft_model is not None:
        dm = draft_model if not isinstance(draft_model, str) else load_draft_model(draft_model, rt.tokenizer, rt.home)
        comp = model_components(dm, prefix="draft/", kind_override="draft-model", roles_override=("drafter",),
                                spill_root=spill)
        rt.phaseswap.add_all(comp)
        rt.drafter = DraftModel(dm, comp[0].name)
    elif drafter == "prompt-lookup":
        rt.drafter = PromptLookup()
    rt.phaseswap.enter("idle")
    resident = rt.phaseswap.resident_bytes()
    if rt.memory_budget is not None and resident > rt.memory_budget:
        needed = {c.name: c.size() for c in rt.phaseswap.components.values()}
        rt.phaseswap.budget.refuse("load", needed, resident, 0, 0)


def set_drafter(rt, name: str):
    """Switch drafting: 'none' or 'prompt-lookup' (a draft model is given at Runtime construction)."""
    rt.drafter = PromptLookup() if name == "prompt-lookup" else None
    rt.gate = Gate()


def turn_steps(rt, tokens, cache, reused_tokens, max_tokens, sampler, greedy, stop, stats):
    """The token generator of one turn (drop-in for mlx-lm's generate_step), phases switched inside."""
    from .decode import phased_steps

    counts = {}
    steps = phased_steps(rt.model, tokens[reused_tokens:], cache, rt.phaseswap, max_tokens,
                         None if greedy else sampler, rt.drafter if greedy else None, rt.gate,
                         history=tokens[:reused_tokens], stop=stop, counts=counts)
    try:
        yield from steps
    finally:
        steps.close()
        rt.phaseswap.enter("idle")
        stats["drafter"] = rt.drafter.name if (rt.drafter is not None and greedy) else "none"
        stats["reload_s"] = counts.get("reload_s", 0.0)
        for key in ("draft_passes", "drafted_tokens", "accepted_tokens"):
            stats[key] = counts.get(key, 0)
        drafted = counts.get("drafted_tokens", 0)
        stats["acceptance"] = counts.get("accepted_tokens", 0) / drafted if drafted else 0.0


def add_cache(rt, name: str, caches) -> Component:
    """Register a cache list's KV as a component (spilled to JUSTFIT_HOME/spill in a tool phase)."""
    from .kvspill import cache_component

    comp = rt.phaseswap.add(cache_component(name, caches, rt.home / "spill"))
    rt.phaseswap.kv_of[id(caches)] = name
    return comp
