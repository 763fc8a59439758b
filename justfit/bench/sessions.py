"""`justfit bench sessions`: an agent-shaped multi-turn workload, mlx-lm vs JustFit sessions.

A system prompt with a tool schema (~4k tokens by default), then turns of 32-128 new user tokens with short
greedy replies; then `next-turn` rounds (a 64-token message on the whole history, first token timed, then
undone), interleaved between systems, medians of >= 3 rounds; then 3 sub-agents forked from the history;
then restarts (new processes, one per round) that resume it.
Systems: `mlx-lm-reprefill` (a fresh KVCache and the whole history prefilled every turn),
`mlx-lm-prompt-cache` (one mlx-lm KVCache kept across turns, trimmed to the common prefix: what
mlx-lm's server does), `justfit` (a StateTrans session: pages, prefix index, checkpoints).
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import typer

from .baseline import mlx_lm_layout
from .stats import spread

TURN_SIZES = (32, 64, 96, 128)


def _log(msg: str):
    print(msg, file=sys.stderr, flush=True)


def system_prompt(tokenizer, target: int) -> str:
    """An agent system prompt plus a JSON tool schema, grown until it has about `target` tokens."""
    head = ("You are a coding agent working in a sandboxed repository. Think step by step, call tools "
            "with JSON arguments, read files before editing them, and run the tests after each change.\n"
            "Available tools:\n")
    tools, i = [], 0
    verbs = ["read_file", "write_file", "run_tests", "search_code", "list_dir", "git_diff", "apply_patch",
             "run_shell", "fetch_docs", "open_issue"]
    while len(tokenizer.encode(head + json.dumps(tools, indent=1))) < target:
        v = verbs[i % len(verbs)]
        tools.append({"name": f"{v}_{i}", "description": f"Tool {i}: {v.replace('_', ' ')} on the project; "
                      f"returns text, an exit status and at most {100 + i} lines.",
                      "parameters": {"type": "object", "properties": {
                          "path": {"type": "string", "description": "a path relative to the repository root"},
                          "limit": {"type": "integer", "description": f"maximum lines, default {20 + i}"}},
                          "required": ["path"]}})
        i += 1
    return head + json.dumps(tools, indent=1)


def user_message(tokenizer, turn: int, n_tokens: int) -> str:
    """A tool-result-like user message of about n_tokens tokens."""
    text = (f"Tool result for step {turn}: the command finished with exit status {turn % 3}. "
            "Output follows: test_parse passed, test_render failed with an assertion about the header "
            "width, test_io passed, and the coverage report shows 81 percent of lines in src/render.py. ") * 8
    ids = tokenizer.encode(text)[:n_tokens]
    return tokenizer.decode(ids) + "\nWhat next?"


class MlxLmReprefill:
    """mlx-lm as most scripts use it: the whole chat history prefilled into a fresh cache every turn."""

    name = "mlx-lm-reprefill"

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer

    def turn(self, messages, max_tokens):
        from mlx_lm.models.cache import make_prompt_cache

        tokens = _template(self.tokenizer, messages)
        return _run(self.model, self.tokenizer, tokens, make_prompt_cache(self.model), 0, max_tokens), tokens


class MlxLmPromptCache:
    """mlx-lm with one prompt cache kept in memory across turns, trimmed to the longest common prefix."""

    name = "mlx-lm-prompt-cache"

    def __init__(self, model, tokenizer):
        from mlx_lm.models.cache import make_prompt_cache

        self.model, self.tokenizer = model, tokenizer
        self.cache, self.cached = make_prompt_cache(model), []

    def turn(self, messages, max_tokens):
        tokens = _template(self.tokenizer, messages)
        common = 0
        for a, b in zip(self.cached, tokens[:-1]):
            if a != b:
                break
            common += 1
        offset = self.cache[0].offset
        if offset > common:
            for c in self.cache:
                c.trim(offset - common)
        row = _run(self.model, self.tokenizer, tokens, self.cache, common, max_tokens)
        self.cached = tokens + row.pop("_tokens")
        return row, tokens


def _template(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _run(model, tokenizer, tokens, cache, reused, max_tokens):
    """Greedy turn with mlx-lm's generate_step: prefill tokens[reused:], decode; timing row."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    with mlx_lm_layout(model):  # the weights as mlx_lm.load lays them out
        start, first, out = time.perf_counter(), None, []
        eos = set(tokenizer.eos_token_ids)
        for tok, _ in generate_step(mx.array(tokens[reused:]), model, max_tokens=max_tokens, prompt_cache=cache):
            first = first or time.perf_counter()
            if tok in eos:
                break
            out.append(tok)
        end = time.perf_counter()
    return {"ttft_s": first - start, "turn_s": end - start, "reused_tokens": reused, "checkpoint_s": 0.0,
            "disk_bytes_written": 0, "reply": tokenizer.decode(out), "_tokens": out}


def _kv_bytes(cache) -> int:
    return sum(c.nbytes for c in cache)


def _fork_rows(systems, rt, session, history, model, max_tokens):
    """Three sub-agents from the same history: reprefill re-prefills it, prompt-cache deep-copies the
    cache, justfit forks the session (pages shared)."""
    import copy

    rows = []
    for i in range(3):
        task = history + [{"role": "user", "content": f"Sub-agent {i}: summarize the failing test {i} in one line."}]
        for sys_ in systems:
            if isinstance(sys_, MlxLmReprefill):
                row, tokens = sys_.turn(task, max_tokens)
                row["kv_bytes_added"] = None
            elif isinstance(sys_, MlxLmPromptCache):
                child = MlxLmPromptCache.__new__(MlxLmPromptCache)
                child.model, child.tokenizer = sys_.model, sys_.tokenizer
                t0 = time.perf_counter()
                child.cache, child.cached = copy.deepcopy(sys_.cache), list(sys_.cached)
                copy_s = time.perf_counter() - t0
                before = _kv_bytes(sys_.cache)
                row, tokens = child.turn(task, max_tokens)
                row["turn_s"] += copy_s
                row["ttft_s"] += copy_s
                row["kv_bytes_added"] = _kv_bytes(child.cache)  # a full private copy plus its new tokens
                del before
            else:
                pool = rt.index.pool
                before = pool.nbytes
                t0 = time.perf_counter()
                child = session.fork(f"bench-sub{i}")
                fork_s = time.perf_counter() - t0
                g = child.generate(task[-1:], max_tokens=max_tokens)
                st = g.stats.as_dict()
                tokens = child.tokens
                row = {"ttft_s": st["ttft_s"] + fork_s, "turn_s": st["turn_s"] + fork_s,
                       "reused_tokens": st["reused_tokens"], "checkpoint_s": st["checkpoint_s"],
                       "disk_bytes_written": st["disk_bytes_written"], "kv_bytes_added": pool.nbytes - before,
                       "new_tokens": st["prompt_tokens"] - st["reused_tokens"] + st["generated_tokens"]}
                child.close()
            row.pop("_tokens", None)
            row.pop("reply", None)
            rows.append(dict(system=sys_.name, phase="fork", turn=i, history_tokens=len(tokens), **row))
    return rows


def _next_turn_rows(systems, session, histories, msg, rounds):
    """`rounds` x (each system in rotating order): the 64-token message on the whole history, time to the
    first token, then undone (session rewound, prompt cache trimmed back). Medians with min and max."""
    times = {0: [], 1: [], 2: []}
    reused = {}
    for r in range(rounds):
        for k in [(r + j) % 3 for j in range(3)]:
            hist = histories[k] + [{"role": "user", "content": msg}]
            if systems[k] is None or systems[k].name == "justfit":
                n = len(session.tokens)
                t0 = time.perf_counter()
                for _ in session.stream([hist[-1]], max_tokens=1):
                    break
                times[k].append(time.perf_counter() - t0)
                reused[k] = session.last_stats.reused_tokens
                session.rewind(len(session.tokens) - n)
            else:
                cached = getattr(systems[k], "cached", None)
                row, _ = systems[k].turn(hist, 1)
                times[k].append(row["ttft_s"])
                reused[k] = row["reused_tokens"]
                if cached is not None:
                    systems[k].cached = cached  # the next round starts from the same history
    names = ["mlx-lm-reprefill", "mlx-lm-prompt-cache", "justfit"]
    return [{"system": names[k], "phase": "next-turn", "history_tokens": len(session.tokens), "new_tokens": 64,
             "rounds": rounds, **spread("ttft_s", v),
             "reused_tokens": reused[k]} for k, v in times.items()]


def _restart_rows(folder, home, name, kv_bits, cache_file, next_msg, max_tokens, rounds: int = 3):
    """Resume in new processes, one per round (the model load there is not timed): justfit restores the
    session; mlx-lm loads a prompt cache saved by hand; reprefill prefills the same history. The order
    of the three inside a process rotates each round; medians with min and max."""
    per = {}
    for r in range(rounds):
        cmd = [sys.executable, "-m", "justfit.bench.sessions", str(folder), str(home), name, str(kv_bits),
               str(cache_file), next_msg, str(max_tokens), str(r)]
        done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, JUSTFIT_HOME=str(home)))
        if done.returncode != 0:
            raise RuntimeError(f"restart child failed: {done.stderr.strip().splitlines()[-1:]}")
        for row in json.loads(done.stdout.strip().splitlines()[-1]):
            per.setdefault(row["system"], []).append(row)
    out = []
    for rows in per.values():
        v = [x["restore_s"] for x in rows]
        row = dict(rows[-1], rounds=rounds, **spread("restore_s", v))
        out.append(row)
    return out


def _restart_child(folder, home, name, kv_bits, cache_file, next_msg, max_tokens, round_="0"):
    import mlx.core as mx

    import justfit

    rt = justfit.Runtime(model=folder, kv=justfit.KVConfig(bits=int(kv_bits)), home=home)
    steps = [lambda: _restore_justfit(rt, name, next_msg, max_tokens), lambda: _restore_mlx_lm(cache_file),
             lambda: _restore_reprefill(rt, name)]
    r = int(round_) % 3
    rows = [f() for f in steps[r:] + steps[:r]]
    print(json.dumps(rows))
    del mx


def _restore_justfit(rt, name, next_msg, max_tokens):
    t0 = time.perf_counter()
    s = rt.session(name)
    s.prefill()  # load every page and recompute the partial tail: the session is ready to decode
    restore_s = time.perf_counter() - t0
    tokens = list(s.tokens)
    restored = s.kv_tokens
    g = s.generate(next_msg, max_tokens=int(max_tokens))
    s.rewind(len(s.tokens) - len(tokens))  # every round restores the same history
    s.close()
    return {"system": "justfit", "phase": "restore", "history_tokens": len(tokens), "restore_s": restore_s,
            "restored_tokens": restored, "ttft_s": g.stats.ttft_s, "turn_s": g.stats.turn_s,
            "reused_tokens": g.stats.reused_tokens}


def _restore_mlx_lm(cache_file):
    import mlx.core as mx
    from mlx_lm.models.cache import load_prompt_cache

    t0 = time.perf_counter()
    cache, _ = load_prompt_cache(str(cache_file), return_metadata=True)
    mx.eval([c.state for c in cache])
    return {"system": "mlx-lm-prompt-cache", "phase": "restore", "history_tokens": cache[0].offset,
            "restore_s": time.perf_counter() - t0, "note": "load_prompt_cache of a file saved by hand"}


def _restore_reprefill(rt, name):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from ..statetrans.manifest import read_manifest

    tokens = read_manifest(rt.home, name).tokens
    cache = make_prompt_cache(rt.model)
    t0 = time.perf_counter()
    for i in range(0, len(tokens), 2048):
        rt.model(mx.array(tokens[i:i + 2048])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return {"system": "mlx-lm-reprefill", "phase": "restore", "history_tokens": len(tokens),
            "restore_s": time.perf_counter() - t0, "note": "re-prefill of the same history"}


def _measure(folder, home: Path, system_tokens: int, turns: int, rounds: int, reply_tokens: int, kv_bits: int):
    """Every row of the bench: the turns, next-turn rounds, forks and restarts, over `home`."""
    import justfit  # first: it picks the BLAS MLX runs on
    from mlx_lm.models.cache import save_prompt_cache

    rt = justfit.Runtime(model=folder, kv=justfit.KVConfig(bits=kv_bits), home=home)
    tok = rt.tokenizer
    system = system_prompt(tok, system_tokens)
    _log(f"system prompt: {len(tok.encode(system))} tokens; {turns} turns; model {folder}")
    systems = [MlxLmReprefill(rt.model, tok), MlxLmPromptCache(rt.model, tok), None]
    session = rt.session("bench")
    histories = {i: [{"role": "system", "content": system}] for i in range(3)}
    rows = []
    for t in range(turns):
        msg = user_message(tok, t, TURN_SIZES[t % len(TURN_SIZES)])
        order = [(t + k) % 3 for k in range(3)]  # alternate who runs first each turn
        for k in order:
            hist = histories[k] + [{"role": "user", "content": msg}]
            if systems[k] is None:
                g = session.generate(hist if t == 0 else hist[-1:], max_tokens=reply_tokens)
                st = g.stats.as_dict()
                row = {"system": "justfit", "ttft_s": st["ttft_s"], "turn_s": st["turn_s"],
                       "reused_tokens": st["reused_tokens"], "checkpoint_s": st["checkpoint_s"],
                       "disk_bytes_written": st["disk_bytes_written"]}
                history, reply = st["prompt_tokens"], g.text
            else:
                row, tokens = systems[k].turn(hist, reply_tokens)
                row.pop("_tokens", None)
                reply = row.pop("reply")
                row["system"], history = systems[k].name, len(tokens)
            histories[k] = hist + [{"role": "assistant", "content": reply}]
            rows.append(dict(turn=t, history_tokens=history, **row))
            _log(f"turn {t} {row['system']:<20} history {history:5d}  ttft {row['ttft_s']:.3f}s  "
                 f"turn {row['turn_s']:.3f}s  reused {row['reused_tokens']}  ckpt {row['checkpoint_s']:.4f}s")
    systems[2] = type("J", (), {"name": "justfit"})()
    _log(f"next turn: {rounds} interleaved rounds of a 64-token message on the whole history")
    rows += _next_turn_rows(systems, session, histories, user_message(tok, turns + 1, 64), rounds)
    rows += _fork_rows(systems, rt, session, histories[2], rt.model, reply_tokens)
    cache_file = home / "mlx-lm-prompt-cache.safetensors"
    save_prompt_cache(str(cache_file), systems[1].cache)
    session.close()
    _log("restart: resuming in a new process")
    next_msg = user_message(tok, turns, 48)
    rows += _restart_rows(folder, home, "bench", kv_bits, cache_file, next_msg, reply_tokens, rounds)
    return rows


def sessions(
    model: str = typer.Option("default", "--model", "-m", help="Model spec (as for `justfit chat`)."),
    system_tokens: int = typer.Option(4096, "--system-tokens", help="Approximate system prompt + tools size."),
    turns: int = typer.Option(3, "--turns", min=1, help="User turns after the system prompt."),
    rounds: int = typer.Option(3, "--rounds", min=1, help="Interleaved rounds of the next-turn and restart rows."),
    reply_tokens: int = typer.Option(16, "--reply-tokens", min=1, help="Most tokens per reply."),
    kv_bits: int = typer.Option(4, "--kv-bits", help="JustFit KV bits (4, 8, 16)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
):
    """Multi-turn agent sessions: next-turn TTFT, checkpoint cost, forks and restart vs mlx-lm."""
    from importlib.metadata import version

    import justfit
    from justfit.models import backend, resolve

    from .scratch import scratch_home

    folder = resolve(model)
    with scratch_home("justfit-bench-sessions-") as home:
        rows = _measure(folder, home, system_tokens, turns, rounds, reply_tokens, kv_bits)
    out = {"bench": "sessions", "model": str(model), "backend": backend(),
           "versions": {"justfit": justfit.__version__, "mlx": version("mlx"), "mlx_lm": version("mlx-lm")},
           "rows": rows, "summary": summarize(rows)}
    if json_out:
        print(json.dumps(out))
    else:
        for r in rows:
            typer.echo(json.dumps(r))
        typer.echo(json.dumps(out["summary"], indent=1))


def summarize(rows) -> dict:
    """The ratios the bench reports (next-turn and restore speedups, checkpoint cost, fork growth), from the rows."""
    at = {r["system"]: r for r in rows if r.get("phase") == "next-turn"}
    jf = [r for r in rows if r["system"] == "justfit" and "phase" not in r and r["turn"] > 0]
    rest = {r["system"]: r for r in rows if r.get("phase") == "restore"}
    forks = [r for r in rows if r.get("phase") == "fork" and r["system"] == "justfit"]
    return {
        "next_turn_ttft_speedup_vs_reprefill": at["mlx-lm-reprefill"]["ttft_s"] / at["justfit"]["ttft_s"],
        "next_turn_ttft_speedup_vs_prompt_cache": at["mlx-lm-prompt-cache"]["ttft_s"] / at["justfit"]["ttft_s"],
        "restore_speedup_vs_reprefill": rest["mlx-lm-reprefill"]["restore_s"] / rest["justfit"]["restore_s"],
        "restore_speedup_vs_load_prompt_cache": rest["mlx-lm-prompt-cache"]["restore_s"] / rest["justfit"]["restore_s"],
        "max_checkpoint_fraction_of_turn": max(r["checkpoint_s"] / r["turn_s"] for r in jf) if jf else None,
        "fork_kv_bytes_added": [r["kv_bytes_added"] for r in forks],
        "fork_new_tokens": [r["new_tokens"] for r in forks],
    }


if __name__ == "__main__":
    _restart_child(*sys.argv[1:])
