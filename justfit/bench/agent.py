"""`justfit bench agent`: one fixed multi-step tool-using task, run by JustFit's agent and replayed
on plain mlx-lm, re-prefilling every step (`mlx-lm-reprefill`) and with an in-memory prompt cache
that keeps the longest common prefix like mlx-lm's server does (`mlx-lm-prompt-cache`).

The baselines replay exactly the token sequences the JustFit agent produced (prompts, and the same
number of generated tokens fed one at a time), so every system does the same model work except what
its cache saves. Rows: system, step, prompt_tokens, reused_tokens, prefilled_tokens,
generated_tokens, ttft_s, turn_s. Totals per system go in "totals".
"""

import json
import sys
import tempfile
import time
from pathlib import Path

import typer

from .baseline import mlx_lm_layout

NOTES = {
    "README.md": "# Project Falcon\nA small weather station network. See notes/ for plans and status.\n",
    "notes/plan.md": "Plan: install 12 stations by June. Budget 40,000 EUR. Owner: Dana Ortiz.\n",
    "notes/status.md": "Status: 7 stations online. The launch date is 14 March 2027. Risks: supply delays.\n",
    "notes/people.txt": "Dana Ortiz - lead\nSam Lee - hardware\nRiya Patel - data\n",
    "data/readings.csv": "station,temp_c\nA1,12.5\nA2,13.1\nB1,11.8\n",
}
GUIDE = """Rules for working with files:
- Always start by listing the folder you are asked about; never guess file names.
- Prefer search_files when you look for a word or a date; read_file when you need a whole file.
- Quote the exact line that answers the question and name its file.
- Paths are relative to the workspace root; '..' and absolute paths are refused.
- Large files are truncated; if a result says [truncated], search for the part you need instead.
- If a tool returns an error, read it and try a different path or pattern.
- Keep answers to one or two sentences. Do not invent facts that are not in the files.
"""


def _workspace() -> Path:
    root = Path(tempfile.mkdtemp(prefix="justfit-bench-agent-"))
    for rel, text in NOTES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def _justfit(rt, steps: int, guide_repeat: int):
    """Run the agent; its rows and the (prompt, generated) token lists of every step."""
    from justfit_agents.ready import FILES_SYSTEM
    from justfit_agents.sandbox import Workspace

    from justfit_agents import Agent

    ws = Workspace(_workspace())
    system = FILES_SYSTEM + "\n\n" + GUIDE * guide_repeat
    agent = Agent(rt, system=system, tools=ws.tools(files=True), tool_choice="required", max_steps=steps,
                  result_tokens=96, max_string=48)
    del agent.tools["final_answer"]  # a fixed number of tool steps, whatever the model decides
    agent.stop_on_repeat = False
    start = time.perf_counter()
    result = agent.run("Which file says when the launch is, and what is the date?")
    wall = time.perf_counter() - start
    toks = agent.state.tokens
    rows, work = [], []
    for s in result.steps:
        st = s.stats
        p, g = st.prompt_tokens, st.generated_tokens
        work.append((toks[:p], toks[p:p + g]))
        rows.append({"system": "justfit", "step": s.index, "prompt_tokens": p, "reused_tokens": st.reused_tokens,
                     "prefilled_tokens": st.prefilled_tokens, "generated_tokens": g, "ttft_s": st.ttft_s,
                     "turn_s": st.turn_s, "tool": s.call.name if s.call else None})
    return rows, work, wall


def _replay(gen):
    """An mlx-lm sampler that returns the agent's own tokens in order (same work, same outputs)."""
    import mlx.core as mx

    it = iter(gen)
    return lambda logprobs: mx.array([next(it, gen[-1])])


def _mlx_lm(model, work, reuse: bool):
    """Replay the steps on mlx-lm's generate_step with a KVCache: fresh each step, or one cache
    trimmed to the longest common prefix with the next prompt."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    system = "mlx-lm-prompt-cache" if reuse else "mlx-lm-reprefill"
    cache, held, rows = None, [], []
    start = time.perf_counter()
    for i, (prompt, gen) in enumerate(work):
        t0 = time.perf_counter()
        keep = 0
        if reuse and cache is not None:
            while keep < min(len(held), len(prompt) - 1) and held[keep] == prompt[keep]:
                keep += 1
            trim_prompt_cache(cache, len(held) - keep)
        else:
            cache = make_prompt_cache(model)
        forced = _replay(gen)
        ttft = None
        for _ in generate_step(mx.array(prompt[keep:]), model, max_tokens=len(gen), sampler=forced, prompt_cache=cache):
            ttft = ttft or time.perf_counter() - t0
        held = list(prompt) + list(gen)
        rows.append({"system": system, "step": i, "prompt_tokens": len(prompt), "reused_tokens": keep,
                     "prefilled_tokens": len(prompt) - keep, "generated_tokens": len(gen), "ttft_s": ttft,
                     "turn_s": time.perf_counter() - t0})
    return rows, time.perf_counter() - start


def _totals(rows, walls):
    out = {}
    for system, wall in walls.items():
        rs = [r for r in rows if r["system"] == system]
        out[system] = {"steps": len(rs), "prompt_tokens": sum(r["prompt_tokens"] for r in rs),
                       "prefilled_tokens": sum(r["prefilled_tokens"] for r in rs),
                       "ttft_s": sum(r["ttft_s"] for r in rs), "turn_s": sum(r["turn_s"] for r in rs), "wall_s": wall}
    base = out["mlx-lm-reprefill"]
    for t in out.values():
        t["prefilled_vs_reprefill"] = t["prefilled_tokens"] / base["prefilled_tokens"]
        t["wall_vs_reprefill"] = t["wall_s"] / base["wall_s"]
    return out


def agent(
    model: str = typer.Option("default", "--model", "-m", help="'default', an mlx-lm folder, a .gguf or an HF id."),
    steps: int = typer.Option(8, "--steps", min=2, help="Tool-calling steps in the task."),
    guide_repeat: int = typer.Option(4, "--guide-repeat", min=0, help="Copies of the rules block in the system prompt (prompt size)."),
    kv_bits: int = typer.Option(4, "--kv-bits", help="JustFit KV precision: 4, 8 or 16."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
):
    """Agent loop: JustFit agent vs the same steps on mlx-lm (re-prefill, prompt cache)."""
    from importlib.metadata import version

    agents_src = Path(__file__).resolve().parents[2] / "agents"
    if agents_src.is_dir() and str(agents_src) not in sys.path:
        sys.path.insert(0, str(agents_src))  # running from a checkout without `pip install -e .`

    import justfit
    from justfit.grammar import ll_tokenizer
    from justfit.models import backend, resolve
    from justfit.models.vocab import vocab_size

    from .scratch import scratch_home

    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    with scratch_home("justfit-bench-agent-home-") as home:  # no prefix stored by an earlier run is reused
        rt = justfit.Runtime(model=resolve(model), kv=justfit.KVConfig(bits=kv_bits), home=home)
        ll_tokenizer(rt.tokenizer, vocab_size(rt.model))  # built once per process: not part of any step
        rt.generate("Hi", max_tokens=4)  # warm-up
        log("justfit agent ...")
        rows, work, wall = _justfit(rt, steps, guide_repeat)
        walls = {"justfit": wall}
        rt.ensure_resident()  # mlx-lm calls rt.model itself: the weights the agent's tool phases released come back
        for reuse in (False, True):
            log(f"mlx-lm {'prompt cache' if reuse else 're-prefill'} ...")
            with mlx_lm_layout(rt.model):  # the weights as mlx_lm.load lays them out
                r, w = _mlx_lm(rt.model, work, reuse)
            rows += r
            walls[r[0]["system"]] = w
        totals = _totals(rows, walls)
    out = {"bench": "agent", "model": model, "backend": backend(),
           "versions": {"justfit": justfit.__version__, "mlx": version("mlx"), "mlx_lm": version("mlx-lm")},
           "rows": rows, "totals": totals,
           "target": {"prefilled_vs_reprefill": 0.10, "wall_vs_reprefill": 0.30}}
    if json_out:
        print(json.dumps(out))
        return
    typer.echo(f"{'system':<20} {'step':>4} {'prompt':>7} {'reused':>7} {'prefill':>7} {'gen':>4} {'ttft_s':>7} {'turn_s':>7}")
    for r in rows:
        typer.echo(f"{r['system']:<20} {r['step']:>4} {r['prompt_tokens']:>7} {r['reused_tokens']:>7} "
                   f"{r['prefilled_tokens']:>7} {r['generated_tokens']:>4} {r['ttft_s']:>7.2f} {r['turn_s']:>7.2f}")
    for name, t in totals.items():
        typer.echo(f"{name:<20} total prefilled {t['prefilled_tokens']:>6} ({t['prefilled_vs_reprefill']:.1%} of re-prefill), "
                   f"wall {t['wall_s']:.1f} s ({t['wall_vs_reprefill']:.2f}x)")
