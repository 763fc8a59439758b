"""probe.png and compare.png: latency vs budget per context, KV on/off, anomalous bands, KV speedup."""

from pathlib import Path

from ..errors import UserError
from .report import series_rows, title

STYLE = {"on": dict(color="tab:blue", marker="o", ls="-"), "off": dict(color="tab:orange", marker="s", ls="--")}
BAND = {"on": "tab:red", "off": "tab:purple"}


PLOT_HINT = "pip install 'justfit[plot]'"


def have_matplotlib() -> bool:
    """matplotlib is the [plot] extra: without it the probe writes JSON and CSV only."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def _pyplot():
    """matplotlib with a file-only backend, or a UserError naming the extra."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError(f"plots need matplotlib: {PLOT_HINT}") from None
    return plt


def _half_step(budgets):
    """Half the smallest budget spacing: how far a band extends on each side of a budget."""
    gaps = [b - a for a, b in zip(budgets, budgets[1:])]
    return (min(gaps) if gaps else 8) / 2


def draw_panel(ax, report: dict, context: int, legend: bool = True):
    """One context: latency lines with min-max ranges, anomalous bands, speedup on a twin axis."""
    kvs = [kv for kv in ("on", "off") if series_rows(report, context, kv)]
    budgets = sorted({r["budget"] for kv in kvs for r in series_rows(report, context, kv)})
    half = _half_step(budgets)
    top = 0.0
    for kv in kvs:
        rows = series_rows(report, context, kv)
        x = [r["budget"] for r in rows]
        ax.fill_between(x, [r["min_s"] for r in rows], [r["max_s"] for r in rows], color=STYLE[kv]["color"], alpha=0.15, lw=0)
        ax.plot(x, [r["median_s"] for r in rows], ms=3, lw=1.4, label=f"KV {kv}: median of runs (band: min-max)", **STYLE[kv])
        top = max(top, max(r["max_s"] for r in rows))
        shaded = False
        for reg in report["regimes"]:
            if reg["context"] == context and reg["kv"] == kv and reg["label"] == "anomalous":
                ax.axvspan(reg["start"] - half, reg["end"] + half, color=BAND[kv], alpha=0.18,
                           label=None if shaded else f"anomalous, KV {kv}")
                shaded = True
    lows = [r["min_s"] for kv in kvs for r in series_rows(report, context, kv)]
    if lows and top / max(min(lows), 1e-9) > 20:
        from matplotlib.ticker import FuncFormatter

        ax.set_yscale("log")
        plain = FuncFormatter(lambda v, _: f"{v:g}")  # 30, not 3x10^1
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
    ax.set_xlabel("decode budget (max new tokens)")
    ax.set_ylabel("end-to-end generate latency (s)")
    ax.set_title(f"context {context} tokens", fontsize=10)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    on, off = series_rows(report, context, "on"), series_rows(report, context, "off")
    if on and off:
        twin = ax.twinx()
        sp = [(r["budget"], r["kv_speedup"]) for r in on if r["kv_speedup"]]
        twin.plot([b for b, _ in sp], [s for _, s in sp], color="tab:green", marker="x", ms=4, lw=1, ls=":",
                  label="KV speedup (off / on)")
        twin.set_ylabel("KV speedup (latency off / on)", color="tab:green")
        twin.tick_params(axis="y", colors="tab:green")
        twin.set_ylim(0, max(s for _, s in sp) * 1.15 if sp else 1)
        h2, l2 = twin.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    if legend:
        ax.legend(handles, labels, fontsize=7, loc="upper left")


def plot_report(report: dict, path) -> Path:
    """probe.png: one panel per context, side by side."""
    plt = _pyplot()
    contexts = sorted({r["context"] for r in report["summary"]})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6.5 * len(contexts), 4.8), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        draw_panel(ax, report, context)
    verdict = "smooth (no anomalous interval)" if report["verdict"]["smooth"] else \
        f"{report['verdict']['anomalous_intervals']} anomalous interval(s), spike up to {report['verdict']['max_spike_ratio']:.1f}x"
    fig.suptitle(f"{title(report)}\n{verdict}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_compare(a: dict, b: dict, path, names=("A", "B")) -> Path:
    """compare.png: rows = contexts, columns = the two maps, same y range per row."""
    plt = _pyplot()
    contexts = sorted({r["context"] for r in a["summary"]} | {r["context"] for r in b["summary"]})
    fig, axes = plt.subplots(len(contexts), 2, figsize=(13, 4.4 * len(contexts)), squeeze=False, sharey="row")
    for row, context in zip(axes, contexts):
        for ax, rep, name in zip(row, (a, b), names):
            if any(r["context"] == context for r in rep["summary"]):
                draw_panel(ax, rep, context)
            ax.set_title(f"{name}: {title(rep)}\ncontext {context} tokens", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
