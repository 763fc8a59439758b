"""`justfit probe`: sweep, detect regimes, write probe.json/csv/png and save the map.

Importing this module does not import MLX or torch; the command imports them when it runs.
"""

import sys
import time
from pathlib import Path
from typing import Optional, Tuple

import typer

from ..errors import UserError

MIN_MAP_BUDGETS = 8  # fewer budgets a series cannot place a cliff, so such a sweep becomes the map only on request
FULL_SWEEP = "--budgets 128:768:16 --contexts 32,512 --kv on,off --warmup 3 --repeats 5"  # the paper's grid


class Progress:
    """A one-line progress bar on stderr (a line per 10% when stderr is not a terminal)."""

    def __init__(self, stream=sys.stderr, width: int = 28):
        self.stream, self.width, self.start, self.shown = stream, width, time.perf_counter(), -1

    def __call__(self, done: int, total: int, label: str):
        frac = done / max(total, 1)
        elapsed = time.perf_counter() - self.start
        eta = elapsed / frac - elapsed if frac > 0 else 0
        bar = "#" * int(frac * self.width)
        line = f"[{bar:<{self.width}}] {done}/{total} {label}  {elapsed:.0f}s elapsed, ~{eta:.0f}s left"
        if self.stream.isatty():
            self.stream.write("\r\033[K" + line + ("\n" if done == total else ""))
        elif int(frac * 10) != self.shown or done == total:
            self.shown = int(frac * 10)
            self.stream.write(line + "\n")
        self.stream.flush()


def probe(
    model: str = typer.Option("default", "--model", help="'default', an mlx-lm folder, a .gguf, or an HF id (torch: any transformers model)."),
    backend: str = typer.Option("mlx", "--backend", help="mlx (JustFit runtime), mlx-lm (plain mlx-lm) or torch."),
    device: Optional[str] = typer.Option(None, "--device", help="MLX: cpu|gpu. torch: mps|cuda|cpu. Default: the fastest available."),
    budgets: str = typer.Option("16:128:16", "--budgets", help="Decode budgets: start:stop:step (stop included) or a list 64,128."),
    refine: bool = typer.Option(False, "--refine", help="Re-sweep at a finer step around detected transitions and re-measure anomalous budgets."),
    refine_step: Optional[int] = typer.Option(None, "--refine-step", help="Step of the refinement (default: a quarter of the grid step)."),
    contexts: str = typer.Option("32", "--contexts", help="Prompt lengths in tokens, comma-separated."),
    kv: str = typer.Option("on", "--kv", help="KV cache on, off or on,off (off recomputes the sequence every step)."),
    kv_bits: int = typer.Option(4, "--kv-bits", help="Backend mlx: KVExec precision with the cache on (4, 8 or 16)."),
    kv_format: str = typer.Option("affine", "--kv-format", help="Backend mlx: 4-bit KV format (affine or rotated)."),
    warmup: int = typer.Option(1, "--warmup", help="Unrecorded runs before each budget's measured runs."),
    repeats: int = typer.Option(3, "--repeats", help="Measured end-to-end runs per budget."),
    step_runs: int = typer.Option(1, "--step-runs", help="Instrumented runs per budget (sync after every step)."),
    seed: int = typer.Option(42, "--seed", help="Seed of the prompt token ids."),
    out: Path = typer.Option(Path("probe-out"), "--out", help="Folder for probe.json, probe.csv, probe.png (or compare.png)."),
    save_map: Optional[bool] = typer.Option(None, "--save-map/--no-save-map", help=f"Store the result as this device's map under $JUSTFIT_HOME/probe/ (the one --avoid-regimes steers by); by default only a finished sweep of at least {MIN_MAP_BUDGETS} budgets a series is."),
    compare: Optional[Tuple[Path, Path]] = typer.Option(None, "--compare", help="Compare two probe.json files (prints, plots compare.png); no sweep."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Draw probe.png into --out from an existing probe.json; no sweep (needs the [plot] extra)."),
):
    """Map decode latency regimes: budgets x contexts x KV on/off, anomalies flagged and plotted.

    The defaults are a quick sweep (8 budgets, context 32, KV on; about a minute on the default model);
    the paper's full grid is FULL_SWEEP's flags. Ctrl-C stops and saves what was measured so far.
    """
    check_out_dir(out)  # before a sweep that can take many minutes
    if plot:
        from .plot import plot_report
        from .report import load_report

        typer.echo(f"wrote {plot_report(load_report(plot), out / 'probe.png')}")
        return
    if compare:
        from .compare import compare as run_compare

        typer.echo(run_compare(compare[0], compare[1], out))
        return
    from .sweep import parse_budgets, parse_contexts, parse_kv

    grid = {"budgets": parse_budgets(budgets), "contexts": parse_contexts(contexts), "kv": parse_kv(kv),
            "warmup": warmup, "repeats": repeats, "step_runs": step_runs, "seed": seed}
    from ..config import KVConfig
    from .backends import make_backend

    kv_config = KVConfig(bits=kv_bits, format=kv_format)
    sys.stderr.write(f"loading {model} on {backend} ...\n")
    report = run_probe(make_backend(backend, model, device, kv=kv_config), grid, refine, refine_step)
    if report is None:
        typer.echo("interrupted before the first budget was measured: nothing written", err=True)
        raise typer.Exit(130)
    typer.echo(write_outputs(report, out, save_map))
    if report["grid"].get("interrupted"):
        typer.echo(f"interrupted: saved the {len(report['raw'])} cells measured so far in {out}", err=True)
        raise typer.Exit(130)


def run_probe(be, grid: dict, refine: bool = False, refine_step: Optional[int] = None,
              progress=None) -> Optional[dict]:
    """Sweep the grid on a backend (and refine around transitions); return the probe report. Ctrl-C
    ends the sweep: the report then holds the cells measured so far and grid["interrupted"] is True
    (None when not one cell was finished)."""
    from .report import build_report
    from .sweep import Interrupted, merge_records, refine_budgets, run_sweep

    progress = progress or Progress()
    args = {k: grid[k] for k in ("warmup", "repeats", "seed", "step_runs")}
    try:
        records = run_sweep(be, grid["budgets"], grid["contexts"], grid["kv"], progress=progress, **args)
    except Interrupted as stop:
        sys.stderr.write("\n")
        return build_report(be, stop.records, {**grid, "refined": [], "interrupted": True}) if stop.records else None
    report = build_report(be, records, {**grid, "refined": []})
    if refine:
        extra = refine_budgets(report["regimes"], grid["budgets"], refine_step)
        if extra:
            sys.stderr.write(f"refining at {len(extra)} budgets around transitions ...\n")
            try:
                more, stopped = run_sweep(be, extra, grid["contexts"], grid["kv"], progress=progress, **args), False
            except Interrupted as stop:
                more, stopped = stop.records, True
            report = build_report(be, merge_records(records, more), {**grid, "refined": extra, "interrupted": stopped})
    return report


def check_out_dir(out: Path) -> None:
    """Create --out and prove it is writable now, so a bad path fails in a second, not after the sweep."""
    test = Path(out) / ".probe-write-test"
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
        test.write_bytes(b"")
        test.unlink()
    except OSError as e:
        raise UserError(f"cannot write to output folder {out}: {e.strerror or e}") from None


def map_refusal(report: dict) -> Optional[str]:
    """Why this report should not become the device's map unasked (an interrupted or too small sweep)."""
    if report["grid"].get("interrupted"):
        return "the sweep was interrupted"
    counts = {}
    for row in report["summary"]:
        counts[(row["context"], row["kv"])] = counts.get((row["context"], row["kv"]), 0) + 1
    fewest = min(counts.values(), default=0)
    if fewest < MIN_MAP_BUDGETS:
        return f"a series has {fewest} budgets, fewer than the {MIN_MAP_BUDGETS} a map needs to place a cliff"
    return None


def write_outputs(report: dict, out: Path, save_map: Optional[bool] = None) -> str:
    """Write probe.json/csv/png into `out`, save the map (save_map None: only when map_refusal finds
    nothing), and return the closing text."""
    from .maps import save_map as store
    from .plot import PLOT_HINT, have_matplotlib, plot_report
    from .report import write_csv, write_json

    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create output folder {out}: {e.strerror}") from None
    paths = [write_json(report, out / "probe.json"), write_csv(report, out / "probe.csv")]
    lines = [f"wrote {p}" for p in paths]
    if have_matplotlib():
        lines.append(f"wrote {plot_report(report, out / 'probe.png')}")
    else:
        lines.append(f"probe.png not drawn: matplotlib is missing; {PLOT_HINT}, then "
                     f"`justfit probe --plot {out / 'probe.json'} --out {out}`")
    refusal = map_refusal(report) if save_map is None else None
    if save_map or (save_map is None and refusal is None):
        lines.append(f"saved map {store(report)}")
    elif refusal:
        lines.append(f"not saved as this device's map (the one --avoid-regimes steers by): {refusal}; "
                     "pass --save-map to save it anyway")
    v = report["verdict"]
    lines.append("verdict: smooth, no anomalous interval" if v["smooth"] else
                 f"verdict: {v['anomalous_intervals']} anomalous interval(s), spike up to {v['max_spike_ratio']:.2f}x")
    for r in report["regimes"]:
        if r["label"] == "anomalous":
            lines.append(f"  context {r['context']} kv {r['kv']}: budgets {r['start']}-{r['end']}, spike "
                         f"{r['spike_ratio']:.2f}x at {r['peak_budget']}, recovery {r['recovery']}")
    return "\n".join(lines)
