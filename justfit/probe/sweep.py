"""Latency sweeps: decode budgets x prompt contexts x KV cache on/off, timed like the MPS paper.

For each context, KV setting and budget (in that nesting, budgets ascending, as the paper ran
them): `warmup` unrecorded generate calls, `repeats` timed end-to-end generate calls, then
`step_runs` instrumented calls that synchronize after prefill and every decode step.
"""

from typing import Callable, Iterable, List, Optional, Sequence

from ..errors import UserError

KV_VALUES = {"on": True, "off": False}


class Interrupted(Exception):
    """Ctrl-C during a sweep: `records` holds every cell measured in full before it, to be saved."""

    def __init__(self, records: List[dict]):
        super().__init__(f"interrupted after {len(records)} cells")
        self.records = records


def parse_budgets(spec: str) -> List[int]:
    """'128:768:16' (start:stop:step, stop included) or '64,128,256' -> sorted unique budgets."""
    try:
        if ":" in spec:
            parts = [int(p) for p in spec.split(":")]
            if len(parts) != 3 or parts[2] <= 0:
                raise ValueError
            start, stop, step = parts
            out = list(range(start, stop + 1, step))
        else:
            out = [int(p) for p in spec.split(",") if p.strip()]
    except ValueError:
        raise UserError(f"budgets must look like 128:768:16 or 64,128,256, not {spec!r}") from None
    if not out or min(out) < 1:
        raise UserError(f"budgets must be positive integers, got {spec!r}")
    return sorted(set(out))


def parse_contexts(spec: str) -> List[int]:
    """'32,512' -> [32, 512]: prompt lengths in tokens."""
    try:
        out = sorted({int(p) for p in spec.split(",") if p.strip()})
    except ValueError:
        raise UserError(f"contexts must be comma-separated token counts like 32,512, not {spec!r}") from None
    if not out or min(out) < 1:
        raise UserError(f"contexts must be positive token counts, got {spec!r}")
    return out


def parse_kv(spec: str) -> List[str]:
    """'on,off' -> ['on', 'off']."""
    out = [p.strip() for p in spec.split(",") if p.strip()]
    if not out or any(p not in KV_VALUES for p in out):
        raise UserError(f"--kv takes on, off or on,off, not {spec!r}")
    return list(dict.fromkeys(out))


def run_sweep(backend, budgets: Sequence[int], contexts: Sequence[int], kvs: Sequence[str], warmup: int = 3,
              repeats: int = 5, seed: int = 42, step_runs: int = 1,
              progress: Optional[Callable[[int, int, str], None]] = None) -> List[dict]:
    """Time every grid cell; one raw record per (context, kv, budget), see FORMAT.md. Ctrl-C raises
    Interrupted with the cells finished so far."""
    if repeats < 1 or warmup < 0 or step_runs < 0:
        raise UserError("--repeats must be >= 1 and --warmup, --step-runs >= 0")
    records: List[dict] = []
    try:
        _sweep_into(records, backend, budgets, contexts, kvs, warmup, repeats, seed, step_runs, progress)
    except KeyboardInterrupt:
        raise Interrupted(records) from None
    return records


def _sweep_into(records, backend, budgets, contexts, kvs, warmup, repeats, seed, step_runs, progress) -> None:
    from .backends import prompt_ids

    per_cell = warmup + repeats + step_runs
    total, done = len(contexts) * len(kvs) * len(budgets) * per_cell, 0
    for context in contexts:
        ids = prompt_ids(context, backend.vocab_size, seed)
        for kv in kvs:
            for budget in sorted(budgets):
                label = f"context {context} kv {kv} budget {budget}"
                rec = {"context": context, "kv": kv, "budget": int(budget), "warmup_s": [], "e2e_s": [],
                       "prefill_s": [], "step_s": []}
                for phase, n in (("warmup_s", warmup), ("e2e_s", repeats)):
                    for _ in range(n):
                        rec[phase].append(backend.generate(ids, budget, KV_VALUES[kv]))
                        done += 1
                        if progress:
                            progress(done, total, label)
                for _ in range(step_runs):
                    prefill, steps = backend.timed_steps(ids, budget, KV_VALUES[kv])
                    rec["prefill_s"].append(prefill)
                    rec["step_s"].append(steps)
                    done += 1
                    if progress:
                        progress(done, total, label)
                records.append(rec)


def refine_budgets(regimes: Iterable[dict], budgets: Sequence[int], step: Optional[int] = None) -> List[int]:
    """New budgets at a finer step between each transition's last normal and first anomalous
    budget (and back), plus the anomalous budgets again to confirm them."""
    grid = sorted(budgets)
    gaps = [b - a for a, b in zip(grid, grid[1:])]
    coarse = min(gaps) if gaps else 1
    step = step or max(coarse // 4, 1)
    new = set()
    for r in regimes:
        if r["label"] != "anomalous":
            continue
        before = [b for b in grid if b < r["start"]]
        after = [b for b in grid if b > r["end"]]
        for lo, hi in ((before[-1] if before else None, r["start"]), (r["end"], after[0] if after else None)):
            if lo is not None and hi is not None:
                new.update(range(lo + step, hi, step))
        new.update(b for b in grid if r["start"] <= b <= r["end"])
    return sorted(new)


def merge_records(old: List[dict], new: List[dict]) -> List[dict]:
    """Combine two sweeps' records; repeats of one cell are pooled (a confirmation re-run)."""
    cells = {(r["context"], r["kv"], r["budget"]): {k: list(v) if isinstance(v, list) else v for k, v in r.items()}
             for r in old}
    for r in new:
        key = (r["context"], r["kv"], r["budget"])
        if key in cells:
            for k in ("warmup_s", "e2e_s", "prefill_s", "step_s"):
                cells[key][k] += r[k]
        else:
            cells[key] = r
    return [cells[k] for k in sorted(cells, key=lambda k: (k[0], k[1] != "on", k[2]))]
