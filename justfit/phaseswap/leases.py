"""Leases: named, idempotent claims on components; a component with no lease left is evictable.

`acquire(lease, names)` holds every named component and, transitively, the components they depend on
(a LoRA adapter depends on the layers it patches; an untied LM head on nothing; a draft model on
nothing). Acquiring the same lease again replaces its set (idempotent: same set, no change);
releasing an unknown or already released lease is a no-op. When the last lease holding a component
is released, `on_evictable(name)` is called: the residency manager may then evict it (LRU).
"""

from typing import Callable, Dict, Iterable, Optional, Set


class LeaseError(ValueError):
    """A lease names a component that does not exist or has a dependency cycle."""


class Leases:
    """Lease name -> set of component names it holds (dependencies included)."""

    def __init__(self, depends: Callable[[str], Iterable[str]], on_evictable: Optional[Callable[[str], None]] = None):
        self._depends = depends
        self._on_evictable = on_evictable or (lambda name: None)
        self.held: Dict[str, Set[str]] = {}

    def closure(self, names: Iterable[str]) -> Set[str]:
        """The names plus everything they depend on, transitively."""
        out, todo = set(), list(names)
        while todo:
            name = todo.pop()
            if name in out:
                continue
            out.add(name)
            deps = list(self._depends(name))
            if name in deps:
                raise LeaseError(f"component {name!r} depends on itself")
            todo.extend(deps)
        return out

    def acquire(self, lease: str, names: Iterable[str]) -> Set[str]:
        """Hold `names` (and their dependencies) under `lease`; returns the full held set."""
        new = self.closure(names)
        old = self.held.get(lease, set())
        self.held[lease] = new
        self._notify(old - new)
        return new

    def release(self, lease: str) -> None:
        """Drop a lease; components no other lease holds become evictable. Idempotent."""
        old = self.held.pop(lease, None)
        if old:
            self._notify(old)

    def holders(self, name: str) -> Set[str]:
        """Leases currently holding component `name`."""
        return {lease for lease, names in self.held.items() if name in names}

    def is_held(self, name: str) -> bool:
        return any(name in names for names in self.held.values())

    def _notify(self, dropped: Set[str]) -> None:
        for name in sorted(dropped):
            if not self.is_held(name):
                self._on_evictable(name)
