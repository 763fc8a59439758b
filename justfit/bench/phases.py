"""`justfit bench phases`: an agent loop with tool phases, JustFit (a session; weights and its KV pages
released in each tool phase, reloaded just in time; with and without drafting) vs mlx-lm with a prompt
cache (everything stays resident). Each system runs in its own process, so RSS rows are that system's
alone. Rows per system, turn and phase; a tool row's rss_ratio is the process's RSS once released over its RSS
before the phase, and returned_of_released the RSS it gave back over the bytes PhaseSwap released."""

import json
import os
import sys
import threading
import time

import typer

from .baseline import mlx_lm_layout

FILE = ("import os\n\n\ndef walk(root):\n    \"\"\"Yield every file under root.\"\"\"\n    for d, _, files in os.walk(root):\n"
        "        for f in files:\n            yield os.path.join(d, f)\n\n\ndef total_size(root):\n"
        "    return sum(os.path.getsize(p) for p in walk(root))\n")
FIB = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\nprint(fib(10))\n"
WORKLOADS = {  # repeat: the reply copies tool output (prompt lookup helps); novel: it does not
    "repeat": [f"Here is a file:\n```python\n{FIB}```\nRepeat the file exactly.",
               f"Here is another file:\n```python\n{FILE}```\nRepeat the file exactly."],
    "novel": ["Write a short poem about the sea.", "Now write one about the mountains."],
}


class Sampler:
    """Peak process RSS over a phase, sampled every 5 ms in a thread."""

    def __init__(self):
        import psutil

        self.proc, self.peak, self.on = psutil.Process(), 0, False

    def __enter__(self):
        import mlx.core as mx

        mx.reset_peak_memory()
        self.peak, self.on = self.proc.memory_info().rss, True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self):
        while self.on:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.005)

    def __exit__(self, *exc):
        import mlx.core as mx

        self.on = False
        self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
        self.mlx_peak = mx.get_peak_memory()


def run_tool(mb: int, seconds: float):
    """A tool that allocates (and touches) `mb` MB, works a little, then frees it."""
    import numpy as np

    buf = np.ones(mb * 2**20 // 8)
    time.sleep(seconds)
    del buf


def cold_read_s(rt) -> float:
    """Seconds to read the bytes a reload reads (the released-weight copies, else the model files)
    after evicting them from the page cache."""
    import mlx.core as mx

    from ..phaseswap.components import spill_folder

    spill = spill_folder(rt.model, rt.home / "spill")
    folder = str(spill) if spill is not None and spill.is_dir() else rt.model.justfit_path
    files = [os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors")]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    t0 = time.perf_counter()
    for f in files:
        arrays = mx.load(f)
        mx.eval(list(arrays.values()))
        del arrays
    return time.perf_counter() - t0


def _decode(steps, eos):
    toks, t_first = [], None
    for t, _ in steps:
        if t_first is None:
            t_first = time.perf_counter()
        if t in eos:
            break
        toks.append(t)
    n = len(toks)
    return toks, (n - 1) / (time.perf_counter() - t_first) if n > 1 else 0.0


def _reuse(cache, cached, ids) -> int:
    """Tokens of `ids` already in the cache (longest common prefix); the rest of the cache is trimmed."""
    cached = cached + [-1] * (cache[0].offset - len(cached))  # e.g. a fed end-of-turn token
    n = 0
    for a, b in zip(cached, ids[:-1]):
        if a != b:
            break
        n += 1
    for c in cache:
        c.trim(c.offset - n)
    return n


def mlx_lm_turns(rt, workload, tokens, tool_mb, tool_s, rows):
    """mlx-lm generate_step with one growing prompt cache; nothing is released during tools."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    rt.phaseswap.enter("decode")  # everything resident (a JustFit tool phase may have released it) ...
    rt.phaseswap.enter("idle")  # ... and unleased: mlx-lm then calls rt.model directly
    cache, history, eos = make_prompt_cache(rt.model), [], set(rt.tokenizer.eos_token_ids)
    cached = []
    for turn, text in enumerate(WORKLOADS[workload]):
        msgs = history + [{"role": "user", "content": text}]
        ids = rt.encode(msgs)
        reuse = _reuse(cache, cached, ids)
        with mlx_lm_layout(rt.model), Sampler() as s:  # the weights as mlx_lm.load lays them out
            toks, tps = _decode(generate_step(mx.array(ids[reuse:]), rt.model, max_tokens=tokens, prompt_cache=cache), eos)
        cached = ids + toks
        history = msgs + [{"role": "assistant", "content": rt.tokenizer.decode(toks)}]
        rows.append(dict(system="mlx-lm-prompt-cache", workload=workload, turn=turn, phase="decode", drafter="none",
                         rss_bytes=s.peak, mlx_active_bytes=s.mlx_peak, decode_tok_s=tps, tokens=len(toks)))
        with Sampler() as s:
            run_tool(tool_mb, tool_s)
        rows.append(dict(system="mlx-lm-prompt-cache", workload=workload, turn=turn, phase="tool",
                         rss_bytes=s.peak, mlx_active_bytes=mx.get_active_memory()))


def justfit_turns(rt, workload, drafter, tokens, tool_mb, tool_s, rows):
    """JustFit: a named session, a tool phase between turns (weights + the session's KV pages released),
    then the weights (reload_s) and the pages from the store (kv_restore_s) brought back and timed."""
    import mlx.core as mx
    import psutil

    rt.set_drafter(drafter)
    session, proc = rt.session(f"bench-{workload}-{drafter}"), psutil.Process()
    for turn, text in enumerate(WORKLOADS[workload]):
        with Sampler() as s:
            g = session.generate(text, max_tokens=tokens)
        st = g.stats
        rows.append(dict(system="justfit", workload=workload, turn=turn, phase="prefill", drafter=st.drafter,
                         prefill_s=st.prefill_s, prompt_tokens=st.prefilled_tokens))
        rows.append(dict(system="justfit", workload=workload, turn=turn, phase="decode", drafter=st.drafter,
                         rss_bytes=s.peak, mlx_active_bytes=s.mlx_peak, decode_tok_s=st.decode_tok_s,
                         acceptance=st.acceptance, accepted_tokens=st.accepted_tokens,
                         drafted_tokens=st.drafted_tokens, tokens=st.generated_tokens))
        rss_before, active_before, kv_before = proc.memory_info().rss, mx.get_active_memory(), session.resident_bytes()
        with session.tool_phase() as released:
            rss_released, kv_after = proc.memory_info().rss, session.resident_bytes()
            with Sampler() as s:
                run_tool(tool_mb, tool_s)
            active = mx.get_active_memory()
        t0 = time.perf_counter()
        rt.ensure_resident()  # the weights back (the next turn's prefill would do it just in time)
        t1 = time.perf_counter()
        mx.eval([c.state for c in session.cache])  # the released pages back from the store
        restore_s = time.perf_counter() - t1
        rows.append(dict(system="justfit", workload=workload, turn=turn, phase="tool", drafter=st.drafter,
                         rss_bytes=s.peak, mlx_active_bytes=active, released_bytes=released,
                         kv_released_bytes=kv_before - kv_after, kv_restore_s=restore_s, reload_s=t1 - t0,
                         rss_before_bytes=rss_before, rss_after_release_bytes=rss_released,
                         mlx_active_before_bytes=active_before, rss_ratio=rss_released / rss_before,
                         returned_of_released=(rss_before - rss_released) / released if released else 0.0))
    session.close()


def _child(system: str, workload: str, drafter: str, tokens: str, tool_mb: str, tool_s: str, folder: str,
           home: str):
    """One system on one workload in this process; prints its rows as one JSON line."""
    from ..runtime import Runtime

    rt = Runtime(model=folder, home=home)
    rows = []
    if system == "mlx-lm-prompt-cache":
        mlx_lm_turns(rt, workload, int(tokens), int(tool_mb), float(tool_s), rows)
    else:
        justfit_turns(rt, workload, drafter, int(tokens), int(tool_mb), float(tool_s), rows)
    if system == "justfit" and drafter == "none":
        for r in rows:
            if "reload_s" in r:
                r["cold_read_s"] = cold_read_s(rt)
                break
    print(json.dumps(rows))


def _run_child(*args) -> list:
    import subprocess

    done = subprocess.run([sys.executable, "-m", "justfit.bench.phases", *map(str, args)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"bench phases child {args[:3]} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def phases(
    model: str = typer.Option("default", "--model", help="Model for both systems."),
    tokens: int = typer.Option(32, "--tokens", help="Tokens generated per turn."),
    tool_mb: int = typer.Option(300, "--tool-mb", help="MB the tool allocates during each tool phase."),
    tool_s: float = typer.Option(0.5, "--tool-s", help="Seconds each tool runs."),
    workloads: str = typer.Option("repeat,novel", "--workloads", help="repeat (tool output repeated) and/or novel."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
):
    """Agent loop with tool phases: memory per phase, reload time, decode speed with and without drafting."""
    from importlib.metadata import version

    from .. import __version__
    from ..models import backend
    from ..models import resolve
    from .scratch import scratch_home

    folder = resolve(model)
    rows = []
    with scratch_home("justfit-bench-phases-") as home:
        for w in workloads.split(","):
            for system, drafter in (("mlx-lm-prompt-cache", "none"), ("justfit", "none"), ("justfit", "prompt-lookup")):
                print(f"[phases] {w}: {system} drafter={drafter} (own process)", file=sys.stderr)
                rows += _run_child(system, w, drafter, tokens, tool_mb, tool_s, folder, str(home))
    out = {"bench": "phases", "model": model, "backend": backend(),
           "versions": {"justfit": __version__, "mlx": version("mlx"), "mlx_lm": version("mlx-lm")},
           "rows": rows}
    if json_out:
        print(json.dumps(out))
        return
    for r in rows:
        print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))


if __name__ == "__main__":
    _child(*sys.argv[1:])
