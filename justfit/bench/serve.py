"""`justfit bench serve`: `justfit serve` vs `mlx_lm.server`, both started here as subprocesses on
loopback on the same model folder and driven by the same async httpx client.

Workload: an agent trace per conversation: a system prompt, then `turns` turns that each add a scripted
tool call and a tool result (growing the history to ~4k tokens at the defaults), each turn a streamed
greedy reply, sent through the APIs asked for (`--apis`: chat completions, OpenAI Responses, Anthropic
Messages; serve_apis.py; mlx_lm.server through chat completions) with `--tools-words` of tool descriptions
in the system prompt; conversations run at concurrency 1, 4 and 8 (at concurrency c, c conversations send
their turns at once: justfit batches them in its engine, `max_batch` is the largest batch its /metrics
saw). Then both servers restart and every conversation sends its next turn (`after-restart`; justfit serve
runs with --persist, so its prefix cache is saved at shutdown for the APIs that name no session). Timings
are medians over interleaved rounds (each round starts both servers fresh, in
alternating order) with min and max.
"""

import asyncio
import json
import os
from typing import List, Optional

import typer

from .serve_apis import APIS
from .scratch import scratch_home
from .serve_trace import Server, _log, run_phase, trace
from .stats import percentile, spread


def cached_share(reqs: List[dict], before: List[dict]) -> Optional[float]:
    """The least share, over conversations, of the previous turn's prompt tokens a turn found cached."""
    prev = {(r["conv"], r["turn"]): r.get("prompt_tokens") for r in before}
    shares = [r["cached_tokens"] / prev[r["conv"], r["turn"] - 1] for r in reqs
              if r.get("cached_tokens") is not None and prev.get((r["conv"], r["turn"] - 1))]
    return min(shares) if shares else None


def summarize(reqs: List[dict]) -> dict:
    ttft = [r["ttft_s"] for r in reqs]
    gaps = [g for r in reqs for g in r["gaps"]]
    wall = max(r["end"] for r in reqs) - min(r["start"] for r in reqs)
    cached = [r["cached_tokens"] for r in reqs if r["cached_tokens"] is not None]
    return {"requests": len(reqs), "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
            "itl_p50_s": percentile(gaps, 0.5), "itl_p99_s": percentile(gaps, 0.99),
            "throughput_tok_s": sum(r["completion_tokens"] for r in reqs) / wall if wall > 0 else None,
            "cached_tokens": sum(cached) if cached else None}


def one_round(system: str, api: str, folder: str, convs, turns: int, max_tokens: int, concurrency: int) -> List[dict]:
    """Start the server fresh, run the trace through `api`, restart it, run the next turn; rows for this round."""
    with scratch_home(f"justfit-bench-serve-{system}-") as home:
        srv = Server(system, folder, home)
        try:
            res = asyncio.run(run_phase(srv.url, api, srv.model, convs, range(turns), max_tokens, concurrency))
            rss = srv.peak_rss()  # read before the process (and its /proc entry) goes
            batch = srv.max_batch()
        finally:
            srv.stop()
        restarted = Server(system, folder, home)
        try:
            after = asyncio.run(run_phase(restarted.url, api, restarted.model, convs, range(turns, turns + 1), max_tokens,
                                          concurrency))
            rss2 = restarted.peak_rss()
            batch2 = restarted.max_batch()
        finally:
            restarted.stop()
    base = {"system": system, "api": api, "concurrency": concurrency, "start_s": srv.start_s, "max_batch": batch}
    first = res[0]
    later = [r for t in range(1, turns) for r in res[t]]
    everything = [r for t in range(turns) for r in res[t]]
    return [{**base, "workload": "first-turn", **summarize(first), "peak_rss_bytes": rss},
            {**base, "workload": "later-turns", **summarize(later), "peak_rss_bytes": rss,
             "cached_share_min": cached_share(later, everything)},
            {**base, "workload": "after-restart", **summarize(after[turns]), "peak_rss_bytes": rss2,
             "cached_share_min": cached_share(after[turns], everything), "start_s": restarted.start_s,
             "max_batch": batch2}]


def serve(
    model: str = typer.Option("default", "--model", "-m", help="Model spec (as for `justfit serve`)."),
    turns: int = typer.Option(10, "--turns", min=2, help="Turns per conversation (history grows each turn)."),
    result_words: int = typer.Option(230, "--result-words", min=10, help="Words per tool result (~300 tokens)."),
    tools_words: int = typer.Option(0, "--tools-words", min=0, help="Words of tool descriptions in the system "
                                    "prompt (an agent CLI's tool-laden prefix; ~1.3 tokens a word)."),
    max_tokens: int = typer.Option(32, "--max-tokens", min=1, help="Tokens per reply."),
    concurrency: str = typer.Option("1,4,8", "--concurrency",
                                    help="Comma-separated concurrency levels (conversations at once)."),
    rounds: int = typer.Option(3, "--rounds", min=1, help="Interleaved rounds per system and level."),
    apis: str = typer.Option("chat", "--apis", help="Comma-separated APIs justfit serve is driven through: chat "
                             "(completions), responses (OpenAI Responses), messages (Anthropic); mlx_lm.server "
                             "speaks chat only."),
    quick: bool = typer.Option(False, "--quick", help="Smoke run: at most 3 turns, 40-word tool results, 8 "
                               "tokens and 1 round; concurrency 1,4 unless given."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    models: Optional[str] = typer.Option(None, "--models", help="Two comma-separated model specs: the alternating "
                                         "two-model trace instead (serve_models.py): under one budget, without it, "
                                         "and against two mlx_lm.server processes."),
    memory_budget: Optional[str] = typer.Option(None, "--memory-budget", help="With --models: the budget (default: "
                                                "the larger model and 3/4 of the smaller, so both never fit)."),
):
    """justfit serve vs mlx_lm.server on a multi-turn agent trace: TTFT, ITL, throughput, RSS, restart."""
    from importlib.metadata import version

    from justfit.models import resolve

    if quick:
        turns, result_words, max_tokens = min(turns, 3), min(result_words, 40), min(max_tokens, 8)
        concurrency, rounds = ("1,4" if concurrency == "1,4,8" else concurrency), min(rounds, 1)
    if models is not None:
        return _serve_models(models, memory_budget, turns, max_tokens, result_words, rounds, json_out)
    folder = str(resolve(model))
    try:
        levels = [int(x) for x in concurrency.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"--concurrency takes comma-separated integers, not {concurrency!r}") from None
    if not levels or min(levels) < 1:
        raise typer.BadParameter("--concurrency needs levels >= 1")
    chosen = [a.strip() for a in apis.split(",") if a.strip()]
    if not chosen or any(a not in APIS for a in chosen):
        raise typer.BadParameter(f"--apis takes a comma-separated subset of {', '.join(APIS)}, not {apis!r}")
    systems = [("justfit-serve", a) for a in chosen] + [("mlx-lm-server", "chat")]
    raw = []
    for level in levels:
        convs = [trace(c, turns, result_words, tools_words) for c in range(level)]
        for r in range(rounds):
            for system, api in (systems if r % 2 == 0 else systems[::-1]):
                _log(f"round {r + 1}/{rounds}: {system} ({api}) at concurrency {level}")
                rows = one_round(system, api, folder, convs, turns, max_tokens, level)
                for row in rows:  # each row in full on stderr, so an interrupted run keeps what it measured
                    _log("  " + json.dumps(row))
                raw += [{**row, "round": r} for row in rows]
    rows = aggregate(raw)
    out = {"bench": "serve", "model": folder, "turns": turns, "max_tokens": max_tokens, "rounds": rounds,
           "load_avg": os.getloadavg(), "versions": {p: version(p) for p in ("justfit", "mlx", "mlx-lm")},
           "rows": rows, "ratios": ratios(rows)}
    if json_out:
        print(json.dumps(out, indent=1))
    else:
        for row in rows:
            typer.echo(f"{row['system']:<14} {row['api']:<9} {row['workload']:<13} c={row['concurrency']:<2} "
                       f"ttft p50 {row['ttft_p50_s']:.3f}s [{row['ttft_p50_s_min']:.3f}-{row['ttft_p50_s_max']:.3f}] "
                       f"tok/s {row['throughput_tok_s']:.1f}  rss {(row['peak_rss_bytes'] or 0) / 1e6:.0f} MB"
                       + (f"  batch<={row['max_batch']:.0f}" if row["max_batch"] is not None else ""))
        typer.echo(json.dumps(out["ratios"], indent=1))


def _serve_models(models: str, memory_budget: Optional[str], turns: int, max_tokens: int, result_words: int,
                  rounds: int, json_out: bool):
    from justfit.models import default_model, resolve
    from justfit.phaseswap import parse_budget

    from .serve_models import budget_for, run

    specs = [m.strip() for m in models.split(",") if m.strip()]
    if len(specs) != 2:
        raise typer.BadParameter(f"--models takes two comma-separated model specs, not {models!r}")
    folders = [str(default_model()) if s == "default" else str(resolve(s)) for s in specs]
    longest = 100 + turns * (30 + result_words * 5)  # more than the last turn's prompt tokens
    budget = parse_budget(memory_budget) if memory_budget else budget_for(folders, longest)
    out = run(folders, budget, turns, max_tokens, result_words, rounds)
    if json_out:
        print(json.dumps(out, indent=1))
        return
    for row in out["rows"]:
        typer.echo(f"{row['system']:<15} ttft p50 {row['ttft_p50_s']:.3f}s p99 {row['ttft_p99_s']:.3f}s  "
                   f"rss {(row['peak_rss_bytes'] or 0) / 1e6:.0f} MB (budget {budget / 1e6:.0f} MB)"
                   + (f"  reloads {row['reloads']:.0f} weights {row['weights_load_s']:.3f}s kv {row['kv_restore_s']:.3f}s"
                      if row.get("reloads") else ""))


METRICS = ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "throughput_tok_s", "cached_tokens",
           "cached_share_min", "peak_rss_bytes", "start_s", "max_batch")


def aggregate(raw: List[dict]) -> List[dict]:
    """Median over rounds per (system, workload, concurrency), with _min and _max."""
    keys = sorted({(r["system"], r["api"], r["workload"], r["concurrency"]) for r in raw})
    out = []
    for system, api, workload, level in keys:
        group = [r for r in raw if (r["system"], r["api"], r["workload"], r["concurrency"]) == (system, api, workload, level)]
        row = {"system": system, "api": api, "workload": workload, "concurrency": level, "rounds": len(group)}
        for m in METRICS:
            row.update(spread(m, [r.get(m) for r in group]))
        out.append(row)
    return out


def ratios(rows: List[dict]) -> dict:
    """justfit (each API) / mlx-lm on the measures the bench compares (lower is better except throughput),
    and each system's later-turn and after-restart TTFT over its first turn's."""
    def get(system, api, workload, level, m):
        return next((r[m] for r in rows if (r["system"], r["api"], r["workload"], r["concurrency"])
                     == (system, api, workload, level)), None)

    out = {}
    for level in sorted({r["concurrency"] for r in rows}):
        for system, api in sorted({(r["system"], r["api"]) for r in rows}):
            first = get(system, api, "first-turn", level, "ttft_p50_s")
            for workload in ("later-turns", "after-restart"):
                t = get(system, api, workload, level, "ttft_p50_s")
                if first and t is not None:
                    out[f"{system}.{api}.{workload}_over_first.ttft_p50_s.c{level}"] = t / first
            if system != "justfit-serve":
                continue
            for workload, m in (("later-turns", "ttft_p50_s"), ("later-turns", "throughput_tok_s"),
                                ("later-turns", "peak_rss_bytes"), ("after-restart", "ttft_p50_s")):
                a, b = get(system, api, workload, level, m), get("mlx-lm-server", "chat", workload, level, m)
                if a is not None and b:
                    out[f"{api}.{workload}.{m}.c{level}_over_mlx_lm"] = a / b
    return out
