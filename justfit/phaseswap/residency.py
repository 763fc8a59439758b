"""Residency manager: per phase, make the components it needs resident and evict the rest as needed.

Phases and what they lease (by role):
- `prefill`       input-embedding, layers, norm (intermediate chunks never touch the LM head)
- `prefill-last`  the above + lm-head (the last chunk produces the first token's logits)
- `decode`        input-embedding, layers, norm, lm-head, drafter
- `verify`        same as decode (one pass scores 2-8 draft tokens)
- `resident`      every weight of the model: a caller runs `rt.model` itself (mlx-lm on rt.make_cache())
- `tool`          nothing: the agent waits on a tool; weights and KV are released to the OS
- `idle`          nothing is leased, nothing is released until memory is needed
KV components of the cache in use are leased by prefill/decode/verify as well.

Eviction order when a phase does not fit (each class oldest-used first): 1. KV pages already
checkpointed on disk (StateTrans), 2. the draft model, 3. LoRA adapters, 4. other idle weight
components (layer groups, untied head, embedding, norm), 5. KV pages not yet on disk (spilled first
through their own unload hook). Before any of these, the engine's KV manager gives back its speed copies
and cold cached prefixes. Leased components are never evicted. If the need still does not fit,
`MemoryBudgetError` is raised before anything is allocated.
"""

import gc
import time
from functools import lru_cache
from typing import Callable, Dict, Iterable, List, Optional

from .budget import Budget
from .components import Component
from .leases import Leases

PHASE_ROLES = {
    "prefill": {"input-embedding", "layers", "norm", "adapter"},
    "prefill-last": {"input-embedding", "layers", "norm", "lm-head", "adapter"},
    "decode": {"input-embedding", "layers", "norm", "lm-head", "drafter", "adapter"},
    "verify": {"input-embedding", "layers", "norm", "lm-head", "drafter", "adapter"},
    "resident": {"input-embedding", "layers", "norm", "lm-head", "adapter"},  # rt.model used outside a turn
    "tool": set(),
    "idle": set(),
}
PHASES = tuple(PHASE_ROLES)


def _eviction_class(c: Component) -> int:
    """Lower evicts first (see the module docstring)."""
    if c.kind == "kv":
        return 0 if c.checkpointed() else 4
    return {"draft-model": 1, "adapter": 2}.get(c.kind, 3)


def release_memory():
    """Return freed MLX buffers to the OS: dropping references alone leaves them in MLX's cache, and the C
    allocator keeps what MLX frees in its arenas until asked to trim them."""
    import mlx.core as mx

    gc.collect()
    mx.clear_cache()
    trim_heap()


def trim_heap() -> bool:
    """glibc's malloc_trim(0): give the free pages of every malloc arena back to the OS. False where the C
    library has none (musl, macOS: their allocators return large blocks by themselves)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@lru_cache(maxsize=1)
def _malloc_trim():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


class Residency:
    """Components by name, the leases on them, the current phase, and the memory budget."""

    def __init__(self, budget: Optional[Budget] = None):
        self.budget = budget or Budget()
        self.components: Dict[str, Component] = {}
        self.leases = Leases(lambda n: self.components[n].depends if n in self.components else (),
                             self._evictable)
        self.phase = "idle"
        self.evictions: List[str] = []
        self.reload_s = 0.0  # time spent loading in the last enter()
        self.kv_of: Dict[int, str] = {}  # id(cache list) -> KV component name
        # The engine's KV manager, once there is one: its running byte count (every page in the pool, sessions'
        # included, plus decode's speed copies) stands for all KV here, and it gives back what it can spare.
        self.kv_meter: Optional[Callable[[], int]] = None
        self.kv_reclaim: Optional[Callable[[int], None]] = None

    # -- registry -------------------------------------------------------------------------------
    def add(self, component: Component) -> Component:
        self.components[component.name] = component
        return component

    def add_all(self, components: Iterable[Component]):
        for c in components:
            self.add(c)

    def remove(self, name: str):
        """Forget a component (a closed session's KV); its leases are dropped."""
        for lease in list(self.leases.held):
            if name in self.leases.held[lease]:
                self.leases.held[lease].discard(name)
        self.components.pop(name, None)
        self.kv_of = {k: v for k, v in self.kv_of.items() if v != name}

    def meter_kv(self, used: Callable[[], int], reclaim: Callable[[int], None]):
        """Count KV by the engine's one figure (`used()`) instead of summing KV components, so the pool's pages
        are counted once against this budget; `reclaim(n)` frees up to n bytes of speed copies and cold
        cached prefixes before any component is evicted."""
        self.kv_meter, self.kv_reclaim = used, reclaim

    def resident_bytes(self) -> int:
        """Resident weights plus the KV: the engine's figure when metered, else the KV components' own."""
        metered = self.kv_meter is not None
        held = sum(c.size() for c in self.components.values() if c.resident and not (metered and c.kind == "kv"))
        return held + (self.kv_meter() if metered else 0)

    def add_cache(self, name: str, caches, spill_root) -> Component:
        """Register a cache list's KV as a component (spilled to `spill_root` when released)."""
        from .kvspill import cache_component

        return self.add_kv(cache_component(name, caches, spill_root), caches)

    def add_kv(self, component: Component, caches) -> Component:
        """Register the KV component of a cache list; phases that run on `caches` lease it."""
        self.add(component)
        self.kv_of[id(caches)] = component.name
        return component

    # -- phases ---------------------------------------------------------------------------------
    def needed(self, phase: str, caches=None, extra: Iterable[str] = ()) -> List[str]:
        """Names of the components a phase needs (by role), plus the KV of `caches` and `extra`."""
        if phase not in PHASE_ROLES:
            raise ValueError(f"unknown phase {phase!r}; phases are {', '.join(PHASES)}")
        roles = PHASE_ROLES[phase]
        names = [n for n, c in self.components.items() if c.kind != "kv" and set(c.roles) & roles]
        if caches is not None and roles and id(caches) in self.kv_of:
            names.append(self.kv_of[id(caches)])
        return names + [n for n in extra if n in self.components]

    def enter(self, phase: str, caches=None, workspace: int = 0, extra: Iterable[str] = ()) -> float:
        """Switch to `phase`: lease what it needs, evict to make room, load what is missing.
        Returns the seconds spent loading (0 when everything was resident)."""
        names = self.leases.acquire("phase", self.needed(phase, caches, extra))
        self.phase = phase
        missing = [self.components[n] for n in names if not self.components[n].resident]
        new_bytes = sum(c.size() for c in missing)
        self._make_room(phase, names, new_bytes, workspace)
        start = time.perf_counter()
        for c in missing:
            c.load()
            c.resident = True
        now = time.monotonic()
        for n in names:
            self.components[n].last_used = now
        self.reload_s = time.perf_counter() - start if missing else 0.0
        return self.reload_s

    def release(self, kinds: Optional[Iterable[str]] = None) -> int:
        """Unload every unleased, releasable component (of `kinds`, or all); bytes released."""
        kinds = set(kinds) if kinds is not None else None
        freed = 0
        for c in sorted(self.components.values(), key=_eviction_class):
            if c.resident and c.releasable and not self.leases.is_held(c.name) and (kinds is None or c.kind in kinds):
                freed += self._unload(c)
        release_memory()
        return freed

    # -- eviction -------------------------------------------------------------------------------
    def _evictable(self, name: str):
        """Leases call this when a component's last lease goes; eviction itself is lazy (LRU)."""

    def victims(self) -> List[Component]:
        """Resident, unleased, releasable components in eviction order."""
        cands = [c for c in self.components.values()
                 if c.resident and c.releasable and not self.leases.is_held(c.name)]
        return sorted(cands, key=lambda c: (_eviction_class(c), c.last_used))

    def _make_room(self, phase: str, names, new_bytes: int, workspace: int):
        short = self.budget.shortfall(self._counted(), new_bytes, workspace)
        if short > 0 and self.kv_reclaim is not None:
            self.kv_reclaim(short)  # speed copies and cold prefixes: cheaper to rebuild than any component
        victims = self.victims()
        while self.budget.shortfall(self._counted(), new_bytes, workspace) > 0:
            if not victims:
                needed = {n: self.components[n].size() for n in names}
                self.budget.refuse(phase, needed, self.resident_bytes(), new_bytes, workspace)
            self._unload(victims.pop(0))
            release_memory()

    def _counted(self) -> int:
        """Resident bytes where a byte limit reads them (without one only the live memory check runs: every
        step enters a phase, so the count is not taken for nothing)."""
        return self.resident_bytes() if self.budget.limit is not None else 0

    def _unload(self, c: Component) -> int:
        n = c.size()
        c.unload()
        c.resident = False
        self.evictions.append(c.name)
        return n

    # -- visibility -----------------------------------------------------------------------------
    def report(self) -> dict:
        """What is resident, its bytes, who holds it, the phase and the budget."""
        import mlx.core as mx

        rows = [{"name": c.name, "kind": c.kind, "bytes": c.size(), "resident": c.resident,
                 "roles": list(c.roles), "leases": sorted(self.leases.holders(c.name)),
                 "releasable": c.releasable} for c in self.components.values()]
        return {"phase": self.phase, "resident_bytes": self.resident_bytes(),
                "kv_bytes": self.kv_meter() if self.kv_meter is not None else None,
                "budget_bytes": self.budget.limit, "budget": self.budget.describe(),
                "mlx_active_bytes": mx.get_active_memory(), "components": rows}


def format_report(r: dict) -> str:
    """A few lines for `justfit chat --stats`."""
    res = [c for c in r["components"] if c["resident"]]
    out = [f"[phase {r['phase']} | resident {r['resident_bytes'] / 1e6:.1f} MB in {len(res)} of "
           f"{len(r['components'])} components | budget {r['budget']}]"]
    for c in r["components"]:
        mark = "*" if c["resident"] else " "
        out.append(f" {mark} {c['name']:<22} {c['kind']:<12} {c['bytes'] / 1e6:8.1f} MB  {','.join(c['roles'])}")
    return "\n".join(out)
