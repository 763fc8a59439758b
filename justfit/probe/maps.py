"""Regime maps: probe reports saved per device + backend + model + KV config, and steering.

A map is a probe.json (FORMAT.md) stored as `$JUSTFIT_HOME/probe/<key slug>.json`. The runtime asks
`steer_budget` whether a request's (context, budget) falls in an anomalous interval of the map; if
so it reserves the interval's recovery budget (the nearest normal budget above) and still stops
generating at the user's limit.
"""

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

from ..config import home as home_dir
from .report import load_report, validate, write_json


@dataclass(frozen=True)
class MapKey:
    """What a map is valid for: the device, the backend, the model spec and the KV config name."""

    device: str
    backend: str
    model: str
    kv_config: str

    def slug(self) -> str:
        """A file name: readable parts plus a short hash of the exact key."""
        readable = "__".join(re.sub(r"[^A-Za-z0-9.-]+", "-", p).strip("-")[:40] for p in
                             (self.device, self.backend, self.model, self.kv_config))
        digest = hashlib.sha256(json.dumps([self.device, self.backend, self.model, self.kv_config]).encode()).hexdigest()
        return f"{readable}__{digest[:8]}"


def device_label(device: dict) -> str:
    """'cpu:Intel(R) Xeon(R) ...' from a report's device object."""
    return f"{device['kind']}:{device['name']}"


def key_of(report: dict) -> MapKey:
    """The key a probe report is saved under."""
    return MapKey(device_label(report["device"]), report["backend"], report["model"], report["kv_config"])


def runtime_key(runtime) -> MapKey:
    """The key of the map that describes a JustFit Runtime on this machine (backend 'mlx')."""
    from .backends import mlx_device

    return MapKey(device_label(mlx_device()), "mlx", str(runtime.model_spec), runtime.kv.name)


def map_path(key: MapKey, home=None) -> Path:
    """Where the map for `key` lives."""
    return home_dir(home) / "probe" / f"{key.slug()}.json"


def save_map(report: dict, home=None) -> Path:
    """Store a probe report as the map for its key (replacing an older one)."""
    return write_json(report, map_path(key_of(report), home))


def load_map(key: MapKey, home=None) -> Optional[dict]:
    """The map for `key`, or None when there is none; a UserError when the file is invalid."""
    path = map_path(key, home)
    return load_report(path) if path.exists() else None


def list_maps(home=None) -> List[Tuple[Path, MapKey]]:
    """Every valid map under $JUSTFIT_HOME/probe/ with its key; invalid files are skipped."""
    out = []
    for path in sorted((home_dir(home) / "probe").glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if validate(data) is None:
            out.append((path, key_of(data)))
    return out


def nearest_context(report: dict, context_tokens: int, kv: str = "on") -> Optional[int]:
    """The probed context closest to the request's (ties go to the longer one)."""
    contexts = sorted({r["context"] for r in report["regimes"] if r["kv"] == kv})
    if not contexts:
        return None
    return min(contexts, key=lambda c: (abs(c - context_tokens), -c))


def steer(report: dict, context_tokens: int, budget: int, kv: str = "on") -> Tuple[int, Optional[str]]:
    """(budget to reserve, note or None) from one map; see steer_budget."""
    context = nearest_context(report, context_tokens, kv)
    for reg in report["regimes"]:
        if reg["context"] != context or reg["kv"] != kv or reg["label"] != "anomalous":
            continue
        stop = reg["recovery"] if reg["recovery"] is not None else reg["end"] + 1
        if not reg["start"] <= budget < stop:
            continue
        where = (f"budget {budget} at context {context_tokens} falls in the anomalous interval "
                 f"{reg['start']}-{reg['end']} (spike {reg['spike_ratio']:.1f}x) of the probe map for context {context}")
        if reg["recovery"] is None:
            return budget, f"{where}; no normal budget above it was probed, kept {budget}"
        return reg["recovery"], f"{where}; reserved {reg['recovery']}, stopping at {budget}"
    return budget, None


def steer_budget(home, key: MapKey, context_tokens: int, budget: int, kv: str = "on") -> Tuple[int, Optional[str]]:
    """(reserved budget, note or None). With no map, or a request outside every anomalous
    interval, the budget is returned unchanged and the note is None. An unreadable map never
    fails a generation: the budget is kept and the note says why."""
    from ..errors import UserError

    try:
        report = load_map(key, home)
    except UserError as e:
        return budget, f"probe map ignored: {e}"
    if report is None:
        return budget, None
    return steer(report, context_tokens, budget, kv)


def steer_runtime(runtime, context_tokens: int, budget: int) -> Tuple[int, Optional[str]]:
    """steer_budget for a JustFit Runtime: its home, and the map key of its device, model and KV."""
    return steer_budget(runtime.home, runtime_key(runtime), context_tokens, budget)


class RegimeSteering:
    """The decode-budget policy a Runtime takes as `steering=`: (context, max_tokens) -> (reserved, note),
    from this device's map for `model` and `kv` (looked up on each call, so a new probe takes effect)."""

    def __init__(self, model_spec, kv, home=None):
        from .backends import mlx_device

        self.home = home_dir(home)
        self.key = MapKey(device_label(mlx_device()), "mlx", str(model_spec), kv.name)

    def __call__(self, context_tokens: int, max_tokens: int) -> Tuple[int, Optional[str]]:
        return steer_budget(self.home, self.key, context_tokens, max_tokens)
