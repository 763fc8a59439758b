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
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

import typer

from .serve_apis import APIS, one_request
from .stats import percentile, spread

SYSTEM = ("You are a coding agent in a sandboxed repository. Read files before editing them, call one tool "
          "per step with JSON arguments, and run the tests after each change. Tools: read_file(path), "
          "write_file(path, text), run_tests(pattern), search_code(query), list_dir(path). ")


def _log(msg: str):
    print(msg, file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tool_result(turn: int, n_words: int) -> str:
    """A tool result of about n_words words (code-like text: ~1.3 tokens a word)."""
    lines, i = [], 0
    while sum(len(x.split()) for x in lines) < n_words:
        lines.append(f"    def step_{turn}_{i}(self, value): return self.table.get('k{i}', value) + {i * turn}")
        i += 1
    return f"<tool_response name=\"read_file\">\n# src/mod_{turn}.py\n" + "\n".join(lines) + "\n</tool_response>"


def tool_catalog(n_words: int) -> str:
    """Tool descriptions of about n_words words, as agent CLIs put in their system prompts (0: none)."""
    lines, i = [], 0
    while sum(len(x.split()) for x in lines) < n_words:
        lines.append(f"- tool_{i}(path: string, pattern: string, limit: integer): reads or searches the files "
                     f"under path for pattern and returns at most limit matches with their line numbers; call it "
                     f"before editing anything it names, and never with a path outside the repository ({i}).")
        i += 1
    return ("\nTools:\n" + "\n".join(lines)) if lines else ""


def trace(conv: int, turns: int, result_words: int, tools_words: int = 0) -> List[List[dict]]:
    """The prompt (messages) of each turn of conversation `conv`."""
    msgs = [{"role": "system", "content": SYSTEM * 3 + tool_catalog(tools_words)},
            {"role": "user", "content": f"Task {conv}: find why test_render_{conv} fails and fix it."}]
    out = []
    for t in range(turns):
        out.append([dict(m) for m in msgs])
        call = json.dumps({"name": "read_file", "arguments": {"path": f"src/mod_{t}.py"}})
        msgs += [{"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
                 {"role": "user", "content": tool_result(t, result_words)}]
    out.append([dict(m) for m in msgs])  # the turn after the trace: sent after the restart
    return out


class Server:
    """One server subprocess (justfit or mlx_lm) on a free loopback port."""

    def __init__(self, system: str, folder: str, home: Path, extra=()):
        from justfit.blas import openblas_path

        self.system, self.port = system, _free_port()
        self.model = "default" if system == "justfit-serve" else folder  # mlx_lm.server loads other names from the Hub
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, JUSTFIT_HOME=str(home), HF_HUB_CACHE=str(home / "hf"))
        (home / "hf").mkdir(parents=True, exist_ok=True)
        lib = openblas_path()  # the same BLAS for both (justfit's CLI preloads it itself)
        if lib and system == "mlx-lm-server":
            env["LD_PRELOAD"] = f"{lib} {env.get('LD_PRELOAD', '')}".strip()
        cmd = ([sys.executable, "-m", "justfit", "serve", "--model", folder, "--port", str(self.port), "--persist", *extra]
               if system == "justfit-serve" else
               [sys.executable, "-m", "mlx_lm", "server", "--model", folder, "--port", str(self.port)])
        self.log = open(home / f"{system}.log", "ab")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait()
        self.start_s = time.perf_counter() - self.started

    def _wait(self, timeout: float = 300):
        import httpx

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.system} exited with {self.proc.returncode}")
            try:
                path = "/health" if self.system == "justfit-serve" else "/v1/models"
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{self.system} did not start in {timeout} s")

    def peak_rss(self) -> Optional[int]:
        """The process's peak resident set (VmHWM), in bytes."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def max_batch(self) -> Optional[int]:
        """justfit only: the largest running batch its engine saw (from /metrics)."""
        import re

        import httpx

        if self.system != "justfit-serve":
            return None
        m = re.search(r"justfit_batch_running_max (\d+)", httpx.get(self.url + "/metrics", timeout=10).text)
        return int(m.group(1)) if m else None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


async def run_phase(url: str, api: str, model: str, convs: List[List[List[dict]]], turns: range, max_tokens: int,
                    concurrency: int):
    """Each conversation runs `turns` in order through `api`; `concurrency` conversations at a time."""
    import httpx

    results = {t: [] for t in turns}
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=1800) as client:
        async def conversation(c: int):
            async with sem:
                for t in turns:
                    rec = await one_request(client, url, api, model, convs[c][t], max_tokens, f"bench-{c}")
                    results[t].append({**rec, "conv": c, "turn": t})

        await asyncio.gather(*(conversation(c) for c in range(len(convs))))
    return results


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
    home = Path(tempfile.mkdtemp(prefix=f"justfit-bench-serve-{system}-"))
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
