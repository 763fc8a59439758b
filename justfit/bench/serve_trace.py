"""What a serve bench drives: the agent trace (system prompt, tool catalog, scripted tool results) and one
server subprocess (`justfit serve` or `mlx_lm.server`) on a free loopback port, shared by `bench serve`
(serve.py) and its two-model trace (serve_models.py)."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

from .serve_apis import one_request

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
                raise RuntimeError(f"{self.system} exited with {self.proc.returncode}: {self.last_line()}")
            try:
                path = "/health" if self.system == "justfit-serve" else "/v1/models"
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{self.system} did not start in {timeout} s: {self.last_line()}")

    def last_line(self) -> str:
        """The last line of the server's log, and where the log is."""
        self.log.flush()
        path = Path(self.log.name)
        lines = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
        return f"{lines[-1] if lines else '(no output)'} (log: {path})"

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
