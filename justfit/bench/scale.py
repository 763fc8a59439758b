"""`justfit bench scale`: one model on 1 rank vs N ranks (mlx.launch, ring backend) on this machine.

The front process runs the 1-rank systems (mlx-lm's own loop and JustFit); the N-rank JustFit runs as
`mlx.launch -n N` workers that stay loaded and take one command per line on their (broadcast) stdin, so
rounds interleave without reloading. Per system: decode tok/s (median, min, max of the rounds), KV bytes
per rank at a fixed number of cached positions, positions that fit a fixed per-rank KV budget, and the
seconds per decoded token spent in the collectives a token needs (replayed alone on the same ranks).
"""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from typing import List, Optional

import typer

from .baseline import mlx_lm_layout
from .stats import spread

POSITIONS = 512  # cached positions at which KV bytes per rank are measured (two 256-token pages)
PROMPTS = ["Write a short story about a robot who learns to paint.", "Explain how a bicycle stays upright.",
           "Describe a busy market in the morning.", "Give three tips for learning a new language.",
           "Tell me about the history of paper.", "What makes a good cup of tea?",
           "Describe the water cycle to a child.", "Write a short poem about the sea."]
NOTE = ("One 2-core machine: both ranks share the same cores and memory bandwidth, so N ranks cannot decode "
        "faster than one (each token also waits for the hand-offs between ranks). What scales here is memory: "
        "each rank holds 1/N of the layers (pipeline) or of the KV heads (tensor parallel), so the positions "
        "that fit a per-rank budget grow ~N x. On N machines each rank brings its own cores, memory and "
        "bandwidth: a model or a history that does not fit one machine fits N; tensor parallelism splits each "
        "token's work N ways (faster when compute, not the link, dominates: Thunderbolt 5 ~80 Gb/s); pipeline "
        "stages decode one token at a time in sequence, so it adds capacity, not single-stream speed.")


# -- the ranks (inside mlx.launch) ---------------------------------------------------------------------
def kv_per_rank(rt) -> int:
    """KV bytes this rank holds for POSITIONS cached positions (pages sealed in the runtime's format)."""
    import mlx.core as mx

    from ..kvexec import make_cache
    from ..models import vocab_size

    rt.ensure_resident()
    caches = make_cache(rt.model, rt.kv)  # its own pool: the runtime's prefix index stays as it was
    vocab = vocab_size(rt.model)
    ids = mx.array([[(17 * i + 5) % vocab for i in range(POSITIONS)]])
    for i in range(0, POSITIONS, 128):
        rt.model(ids[:, i:i + 128], cache=caches)
        mx.eval([c.state for c in caches])
    n = sum(c.nbytes for c in caches)
    del caches
    return n


def collective_s_per_token(rt, reps: int = 50) -> float:
    """Seconds per decoded token spent in the collectives its forward pass issues, replayed alone."""
    import mlx.core as mx

    from ..distributed import world

    w, s = world(), rt.sharding
    if s.world_size == 1:
        return 0.0
    x = mx.ones_like(rt.model.model.embed_tokens(mx.array([[0]])))  # [1, 1, hidden], whatever the table's layout
    mx.eval(x)

    def one_token():
        if s.kind == "tensor":  # two all_sums per layer (attention out, MLP down), mlx-lm's shard_linear
            outs = [mx.distributed.all_sum(x * (i + 1), group=w.group) for i in range(2 * len(s.layers))]
            mx.eval(outs)
            return
        y = x  # pipeline: one hand-off between neighbouring stages, then the all_gather of the result
        if w.rank < w.size - 1:
            y = mx.distributed.recv_like(x, w.rank + 1, group=w.group)
        if w.rank > 0:
            y = mx.distributed.send(y, w.rank - 1, group=w.group)
        mx.eval(mx.distributed.all_gather(y, group=w.group))

    for _ in range(5):
        one_token()
    start = time.perf_counter()
    for _ in range(reps):
        one_token()
    return (time.perf_counter() - start) / reps


def worker(model: str, kv_bits: int):
    """One rank: load (sharded by the Runtime hook), then answer `round I TOKENS` / `quit` lines."""
    import justfit
    from justfit.distributed import gather_strings, quiet_followers, world

    quiet_followers()
    rt = justfit.Runtime(model=model, kv=justfit.KVConfig(bits=kv_bits), drafter="none")
    kv = [int(x) for x in gather_strings(str(kv_per_rank(rt)))]
    coll = collective_s_per_token(rt)
    print("SCALE " + json.dumps({"ready": True, "sharding": rt.sharding.kind, "kv_bytes_per_rank": kv,
                                 "collective_s_per_token": coll}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        g = rt.generate(PROMPTS[int(cmd[1]) % len(PROMPTS)], max_tokens=int(cmd[2]))
        if world().is_front:
            print("SCALE " + json.dumps({"decode_tok_s": g.stats.decode_tok_s,
                                         "generated_tokens": g.stats.generated_tokens}), flush=True)


# -- the front -----------------------------------------------------------------------------------------
class Ranks:
    """The N-rank worker group under mlx.launch: send a command line, read rank 0's JSON answer."""

    def __init__(self, n: int, model: str, kv_bits: int, timeout: float):
        from ..distributed.launch import launch_command

        cmd = launch_command(n, [sys.executable, "-m", "justfit.bench.scale", "--worker", model, str(kv_bits)])
        self.timeout = timeout
        # own process group: if the ranks hang, close() ends the launcher and every rank it started
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                     start_new_session=True)
        self.lines: "queue.Queue[str]" = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.info = self.read()

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")  # EOF: the launcher has stopped

    def read(self) -> dict:
        """Rank 0's next answer; a launcher that stopped, or no answer within the timeout, is an error."""
        deadline = time.time() + self.timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.time()))
            except queue.Empty:
                line = ""
            if not line:
                break
            if line.startswith("SCALE "):
                return json.loads(line[6:])
        self.close()
        raise RuntimeError(f"the ranks stopped answering within {self.timeout:.0f} s (see the launcher's messages above)")

    def round(self, i: int, tokens: int) -> dict:
        self.proc.stdin.write(f"round {i} {tokens}\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def mlx_lm_round(rt, i: int, tokens: int) -> float:
    """mlx-lm's own loop (KVCache in the compute dtype) on the whole model in this process."""
    from mlx_lm import stream_generate

    rt.ensure_resident()
    model, tokenizer = rt.model, rt.tokenizer
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                           add_generation_prompt=True)
    with mlx_lm_layout(model):  # the weights as mlx_lm.load lays them out
        last = deque(stream_generate(model, tokenizer, prompt, max_tokens=tokens), maxlen=1)[0]
    return last.generation_tps


def summary(values: List[float], name: str) -> dict:
    return {**spread(name, values), "rounds": len(values)}


def scale(
    model: str = typer.Option("default", "--model", help="Model for every system."),
    ranks: int = typer.Option(2, "--ranks", min=2, help="Ranks of the distributed system (mlx.launch -n)."),
    rounds: int = typer.Option(5, "--rounds", min=1, help="Measured rounds (systems alternate within each)."),
    tokens: int = typer.Option(24, "--tokens", min=2, help="Tokens decoded per round."),
    kv_bits: int = typer.Option(4, "--kv-bits", help="KV precision of the JustFit systems: 4, 8 or 16."),
    budget_mb: float = typer.Option(64.0, "--budget-mb", min=0.001, help="Per-rank KV budget for capacity_positions."),
    timeout: float = typer.Option(900.0, "--timeout", help="Seconds to wait for any one answer of the ranks."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
):
    """1 rank vs N ranks on this machine: decode tok/s, KV bytes per rank, capacity, collectives per token."""
    from importlib.metadata import version

    import justfit

    from ..distributed.launch import why_not
    from ..errors import UserError
    from ..models import backend

    reason = why_not()
    if reason:
        raise UserError(f"bench scale needs mlx.launch: {reason}")
    print(f"[scale] loading 1 rank here and {ranks} ranks under mlx.launch", file=sys.stderr)
    rt = justfit.Runtime(model=model, kv=justfit.KVConfig(bits=kv_bits), drafter="none")
    group = Ranks(ranks, model, kv_bits, timeout)
    try:
        one_kv = kv_per_rank(rt)
        runs = {"mlx-lm": [], "justfit-1": [], "justfit-n": []}
        systems = {"mlx-lm": lambda i: mlx_lm_round(rt, i, tokens),
                   "justfit-1": lambda i: rt.generate(PROMPTS[i % len(PROMPTS)], max_tokens=tokens).stats.decode_tok_s,
                   "justfit-n": lambda i: group.round(i, tokens)["decode_tok_s"]}
        for i in range(rounds + 1):  # round 0 warms up every system and is not counted
            order = list(systems) if i % 2 else list(reversed(systems))
            for name in order:
                value = systems[name](i)
                if i:
                    runs[name].append(value)
            print(f"[scale] round {i}/{rounds}: " + ", ".join(f"{k} {v[-1]:.2f} tok/s" for k, v in runs.items() if v),
                  file=sys.stderr)
    finally:
        group.close()
    budget = int(budget_mb * 2**20)
    n_kv = group.info["kv_bytes_per_rank"]
    rows = [
        {"system": "mlx-lm-fp16", "ranks": 1, **summary(runs["mlx-lm"], "decode_tok_s")},
        {"system": "justfit", "ranks": 1, "sharding": "single", **summary(runs["justfit-1"], "decode_tok_s"),
         "kv_bits": kv_bits, "positions": POSITIONS, "kv_bytes": one_kv, "kv_bytes_per_rank": [one_kv],
         "budget_bytes": budget, "capacity_positions": budget * POSITIONS // one_kv, "collective_s_per_token": 0.0},
        {"system": "justfit", "ranks": ranks, "sharding": group.info["sharding"],
         **summary(runs["justfit-n"], "decode_tok_s"), "kv_bits": kv_bits, "positions": POSITIONS,
         "kv_bytes": max(n_kv), "kv_bytes_per_rank": n_kv, "budget_bytes": budget,
         "capacity_positions": budget * POSITIONS // max(n_kv),
         "collective_s_per_token": group.info["collective_s_per_token"]},
    ]
    out = {"bench": "scale", "model": model, "backend": backend(),
           "versions": {"justfit": justfit.__version__, "mlx": version("mlx"), "mlx_lm": version("mlx-lm")},
           "cpu_count": os.cpu_count(), "load_avg_1m": os.getloadavg()[0], "rows": rows, "note": NOTE}
    if json_out:
        print(json.dumps(out))
        return
    for r in rows:
        print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    print(NOTE)


def _main(argv: Optional[List[str]] = None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(argv[1], int(argv[2]))


if __name__ == "__main__":
    _main()
