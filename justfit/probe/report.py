"""probe.json / probe.csv / probe.png from a sweep's raw records (schema in FORMAT.md)."""

import csv
import json
import platform
import time
from pathlib import Path
from typing import List, Optional

import numpy as np

from ..atomic import atomic_write
from ..errors import UserError
from . import regimes as rg

FORMAT = "justfit-probe"
VERSION = 1
CSV_FIELDS = ("context", "kv", "budget", "n", "median_s", "mad_s", "min_s", "max_s", "baseline_s", "ratio",
              "z", "label", "prefill_s", "decode_step_median_s", "decode_step_max_s", "kv_speedup")


def _summary(records: List[dict], detection: dict) -> List[dict]:
    """One row per (context, kv, budget): level, spread, detector verdict, step timings, KV speedup."""
    med = {}
    for r in records:
        med.setdefault((r["context"], r["kv"]), {})[r["budget"]] = float(np.median(r["e2e_s"]))
    speedup = {ctx: rg.kv_speedup(med.get((ctx, "on"), {}), med.get((ctx, "off"), {})) for ctx, _ in med}
    rows = []
    for r in records:
        lab = {x.budget: x for x in detection["labels"][(r["context"], r["kv"])]}[r["budget"]]
        e2e = np.asarray(r["e2e_s"])
        steps = np.concatenate([np.asarray(s, dtype=float) for s in r["step_s"]]) if r["step_s"] else np.array([])
        rows.append({
            "context": r["context"], "kv": r["kv"], "budget": r["budget"], "n": int(e2e.size),
            "median_s": float(np.median(e2e)), "mad_s": float(np.median(np.abs(e2e - np.median(e2e)))),
            "min_s": float(e2e.min()), "max_s": float(e2e.max()), "baseline_s": lab.baseline_s,
            "ratio": lab.ratio, "z": lab.z, "label": "anomalous" if lab.anomalous else "normal",
            "prefill_s": float(np.median(r["prefill_s"])) if r["prefill_s"] else None,
            "decode_step_median_s": float(np.median(steps)) if steps.size else None,
            "decode_step_max_s": float(steps.max()) if steps.size else None,
            "kv_speedup": speedup[r["context"]].get(r["budget"]),
        })
    return rows


def build_report(backend, records: List[dict], grid: dict, params: rg.DetectorParams = rg.DetectorParams()) -> dict:
    """The probe.json object for a finished sweep."""
    series = {}
    for r in records:
        series.setdefault((r["context"], r["kv"]), {})[r["budget"]] = r["e2e_s"]
    detection = rg.detect(series, params)
    anomalous = [r for r in detection["regimes"] if r["label"] == "anomalous"]
    import justfit

    return {
        "format": FORMAT, "version": VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": backend.device, "backend": backend.name,
        "versions": {"justfit": justfit.__version__, "python": platform.python_version(), **backend.versions()},
        "model": backend.model_id, "kv_config": backend.kv_name,
        "grid": {"refined": [], **grid, "budgets": sorted({r["budget"] for r in records})},
        "raw": records,
        "summary": _summary(records, detection),
        "regimes": detection["regimes"],
        "detector": {"method": "trimmed log-log polynomial baseline + neighbour spikes (justfit.probe.regimes)",
                     "params": detection["params"]},
        "verdict": {"smooth": not anomalous, "anomalous_intervals": len(anomalous),
                    "max_spike_ratio": max((r["spike_ratio"] for r in anomalous), default=None)},
    }


def load_report(path) -> dict:
    """Read and check a probe.json; a UserError naming the problem if it is not a valid one."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"no such probe file: {path}") from None
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is not readable JSON: {e}") from None
    problem = validate(data)
    if problem:
        raise UserError(f"{path} is not a valid probe map: {problem}")
    return data


def validate(data) -> Optional[str]:
    """None when `data` follows FORMAT.md, else the first problem found."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return f"format is not {FORMAT!r}"
    if data.get("version") != VERSION:
        return f"version {data.get('version')!r} is not {VERSION}"
    for key in ("device", "backend", "model", "kv_config", "grid", "raw", "summary", "regimes", "verdict"):
        if key not in data:
            return f"missing field {key!r}"
    for row in data["summary"]:
        if row.get("label") not in ("normal", "anomalous") or not row.get("median_s", -1) >= 0:
            return f"bad summary row {row}"
    for reg in data["regimes"]:
        if reg.get("label") not in ("normal", "anomalous") or reg["start"] > reg["end"]:
            return f"bad regime {reg}"
    return None


def write_json(report: dict, path) -> Path:
    """Write probe.json atomically (temp file then rename)."""
    return atomic_write(path, json.dumps(report, indent=1))


def write_csv(report: dict, path) -> Path:
    """probe.csv: the summary rows, one per (context, kv, budget)."""
    path = Path(path)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for row in report["summary"]:
            w.writerow({k: ("" if row[k] is None else row[k]) for k in CSV_FIELDS})
    return path


def series_rows(report: dict, context: int, kv: str) -> List[dict]:
    """Summary rows of one series in budget order."""
    return sorted((r for r in report["summary"] if r["context"] == context and r["kv"] == kv), key=lambda r: r["budget"])


def title(report: dict) -> str:
    """'model · backend · device' for plot titles and printed headers."""
    dev = report["device"]
    return f"{report['model']} · {report['backend']} ({report['kv_config']}) · {dev['kind']} {dev['name']}"
