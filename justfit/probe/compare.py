"""`justfit probe --compare A.json B.json`: two maps side by side, as a table and a picture."""

from pathlib import Path
from typing import List, Optional

from .report import load_report, title


def compare_rows(a: dict, b: dict) -> List[dict]:
    """Cells present in both maps: medians, B/A ratio and both labels."""
    index = {(r["context"], r["kv"], r["budget"]): r for r in b["summary"]}
    rows = []
    for ra in a["summary"]:
        rb = index.get((ra["context"], ra["kv"], ra["budget"]))
        if rb is not None:
            rows.append({"context": ra["context"], "kv": ra["kv"], "budget": ra["budget"],
                         "a_s": ra["median_s"], "b_s": rb["median_s"], "b_over_a": rb["median_s"] / ra["median_s"],
                         "a_label": ra["label"], "b_label": rb["label"]})
    return rows


def _regime_lines(report: dict, name: str) -> List[str]:
    """One line per anomalous interval of a map."""
    out = []
    for r in report["regimes"]:
        if r["label"] == "anomalous":
            rec = r["recovery"] if r["recovery"] is not None else "none"
            out.append(f"  {name}: context {r['context']} kv {r['kv']}: budgets {r['start']}-{r['end']}, "
                       f"spike {r['spike_ratio']:.2f}x at {r['peak_budget']}, recovery {rec}")
    return out or [f"  {name}: no anomalous interval (smooth)"]


def compare_text(a: dict, b: dict, names=("A", "B")) -> str:
    """The printed comparison: headers, regimes of each map, then the common cells."""
    lines = [f"{names[0]}: {title(a)}", f"{names[1]}: {title(b)}", "anomalous intervals:"]
    lines += _regime_lines(a, names[0]) + _regime_lines(b, names[1])
    rows = compare_rows(a, b)
    if not rows:
        lines.append("the two maps share no (context, kv, budget) cell")
        return "\n".join(lines)
    lines.append(f"{'context':>7} {'kv':>3} {'budget':>6} {names[0] + ' s':>10} {names[1] + ' s':>10} "
                 f"{names[1] + '/' + names[0]:>7}  labels")
    for r in rows:
        flag = "" if r["a_label"] == r["b_label"] == "normal" else f"  {r['a_label']} / {r['b_label']}"
        lines.append(f"{r['context']:>7} {r['kv']:>3} {r['budget']:>6} {r['a_s']:>10.3f} {r['b_s']:>10.3f} "
                     f"{r['b_over_a']:>7.2f}{flag}")
    return "\n".join(lines)


def compare(path_a, path_b, out: Optional[Path] = None) -> str:
    """Load two probe.json files, write compare.png into `out` (if given), return the text."""
    from .plot import PLOT_HINT, have_matplotlib, plot_compare

    a, b = load_report(path_a), load_report(path_b)
    names = (Path(path_a).parent.name or "A", Path(path_b).parent.name or "B")
    if names[0] == names[1]:
        names = (f"A ({names[0]})", f"B ({names[1]})")
    text = compare_text(a, b, names)
    if out is not None and not have_matplotlib():
        text += f"\ncompare.png not drawn: matplotlib is missing; {PLOT_HINT}"
    elif out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        png = plot_compare(a, b, Path(out) / "compare.png", names)
        text += f"\nwrote {png}"
    return text
