"""`justfit bench serve --models A,B`: two models behind one server, turns alternating between them.

Each model has one conversation (a persisted session); the trace alternates A, B, A, B... so every turn
under a budget that holds one model at a time unloads the other. Systems, each started fresh per round:
- `justfit-budget`: `justfit serve --model A --model B --memory-budget X` (X holds either model and its
  KV, not both: every switch unloads one and loads the other, and the session restores its KV from disk);
- `justfit-both`: the same without a budget (both stay loaded: no eviction);
- `mlx-lm-2proc`: two `mlx_lm.server` processes, one per model (what one would run without JustFit).
Rows: TTFT p50/p99 per system, the reload split (weights load and session KV restore, from
/justfit/models after each turn) and peak RSS (all processes) against the budget.
"""

import asyncio
import json
import time
from pathlib import Path
from typing import List

from .scratch import scratch_home
from .serve_trace import SYSTEM, Server, _log, tool_result
from .serve_apis import one_request
from .stats import percentile, spread


def budget_for(folders: List[str], prompt_tokens: int) -> int:
    """A budget that holds the larger model with its prefill workspace for a prompt of prompt_tokens, but
    not both models' weights beside it."""
    from types import SimpleNamespace

    from justfit.engine.runner import prefill_workspace
    from justfit.server.pool import estimate_weights

    sizes = sorted(estimate_weights(f) for f in folders)
    args = [SimpleNamespace(**json.loads((Path(f) / "config.json").read_text())) for f in folders]
    workspace = max(prefill_workspace(SimpleNamespace(args=a), prompt_tokens, prompt_tokens, head=True) for a in args)
    return sizes[-1] + sizes[0] * 3 // 4 + workspace


def conversation(model: int, turns: int, result_words: int) -> List[List[dict]]:
    """Turn t's messages for one model: the history grows by a tool result each turn."""
    msgs, out = [{"role": "system", "content": SYSTEM}], []
    for t in range(turns):
        msgs = msgs + [{"role": "user", "content": f"Step {t} for model {model}.\n" + tool_result(t, result_words)}]
        out.append(msgs)
        msgs = msgs + [{"role": "assistant", "content": f"Done step {t}."}]
    return out


async def _trace(urls: List[str], names: List[str], convs, turns: int, max_tokens: int, report: bool) -> List[dict]:
    import httpx

    recs = []
    async with httpx.AsyncClient(timeout=1800) as client:
        for t in range(turns):
            for m in range(len(names)):
                rec = await one_request(client, urls[m], "chat", names[m], convs[m][t], max_tokens, f"bench-models-{m}")
                rec.update(model=m, turn=t)
                if report:
                    info = (await client.get(urls[m] + "/justfit/models")).json()
                    row = next(r for r in info["models"] if r["loaded"] and r["id"] == Path(names[m]).name)
                    rec.update(loads=row["loads"], load_s=row["load_s"], restore_s=row["restore_s"])
                recs.append(rec)
    return recs


def _peak(servers) -> int:
    return sum(s.peak_rss() or 0 for s in servers)


def one_round(system: str, folders: List[str], budget: int, turns: int, max_tokens: int, result_words: int) -> dict:
    convs = [conversation(m, turns, result_words) for m in range(len(folders))]
    with scratch_home(f"justfit-bench-models-{system}-") as home:
        if system == "mlx-lm-2proc":
            servers = [Server("mlx-lm-server", f, home / str(i)) for i, f in enumerate(folders)]
            urls, names = [s.url for s in servers], folders
        else:
            extra = [a for f in folders[1:] for a in ("--model", f)]
            extra += ["--memory-budget", str(budget)] if system == "justfit-budget" else []
            servers = [Server("justfit-serve", folders[0], home, extra=extra)]
            urls, names = [servers[0].url] * len(folders), folders
        try:
            recs = asyncio.run(_trace(urls, names, convs, turns, max_tokens, system != "mlx-lm-2proc"))
            rss = _peak(servers)
        finally:
            for s in servers:
                s.stop()
    later = [r for r in recs if r["turn"] > 0]  # every later turn follows the other model's turn
    ttft = [r["ttft_s"] for r in later]
    row = {"system": system, "requests": len(recs), "ttft_p50_s": percentile(ttft, 0.5),
           "ttft_p99_s": percentile(ttft, 0.99), "peak_rss_bytes": rss,
           "cached_tokens": sum(r.get("cached_tokens") or 0 for r in later)}
    if system != "mlx-lm-2proc":
        reloads, prev = [], {}
        for r in recs:
            if r["loads"] > prev.get(r["model"], r["loads"]):
                reloads.append(r)
            prev[r["model"]] = r["loads"]
        row.update(reloads=len(reloads), weights_load_s=percentile([r["load_s"] for r in reloads], 0.5),
                   kv_restore_s=percentile([r["restore_s"] for r in reloads], 0.5))
    return row


def run(folders: List[str], budget: int, turns: int, max_tokens: int, result_words: int, rounds: int) -> dict:
    systems = ["justfit-budget", "justfit-both", "mlx-lm-2proc"]
    raw = []
    for r in range(rounds):
        for system in (systems if r % 2 == 0 else systems[::-1]):
            _log(f"round {r + 1}/{rounds}: {system}")
            start = time.perf_counter()
            row = one_round(system, folders, budget, turns, max_tokens, result_words)
            _log("  " + json.dumps({**row, "wall_s": time.perf_counter() - start}))
            raw.append(row)
    rows = []
    for system in systems:
        group = [x for x in raw if x["system"] == system]
        out = {"system": system, "rounds": len(group)}
        for m in ("ttft_p50_s", "ttft_p99_s", "peak_rss_bytes", "cached_tokens", "reloads", "weights_load_s",
                  "kv_restore_s"):
            out.update(spread(m, [x.get(m) for x in group]))
        rows.append(out)
    return {"bench": "serve-models", "models": folders, "budget_bytes": budget, "turns": turns,
            "max_tokens": max_tokens, "rounds": rounds, "rows": rows}
