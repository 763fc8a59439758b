"""A/B of two commits on one `justfit bench` command, interleaved in one run on one machine.

Each round runs the bench once per arm (`--json`), in alternating order (A B, B A, ...), each arm's code from its
own git worktree through PYTHONPATH; every bench also times mlx-lm in the same process, so each row carries its
own same-moment baseline. Prints, per bench row (system + workload) and metric, each arm's median with min-max
and the B/A ratio of medians.

Run: python benchmarks/repro/ab_commits.py OLD_REF NEW_REF ROUNDS -- chat --rounds 1 --max-tokens 64
     python benchmarks/repro/ab_commits.py OLD_REF WORKTREE ROUNDS -- batch --concurrency 1,4,16 --rounds 1
NEW_REF may be `WORKTREE` (this checkout as it is, uncommitted edits included).
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
METRICS = ("ttft_s", "decode_tok_s", "throughput_tok_s", "ttft_p50_s", "itl_p50_s")
KEYS = ("system", "concurrency", "prompt_tokens")


def checkout(ref: str, into: Path) -> Path:
    if ref == "WORKTREE":
        return ROOT
    path = into / ref.replace("/", "_")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-f", "--detach", str(path), ref], check=True,
                   capture_output=True)
    return path


def run(tree: Path, args: list) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(tree / "agents")]))
    out = subprocess.run([sys.executable, "-m", "justfit", "bench", *args, "--json"], env=env, cwd=tempfile.gettempdir(),
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out[out.index("{"):])


def rows(result: dict) -> dict:
    """{(system, workload...): {metric: value}} for the metrics a row has."""
    out = {}
    for row in result.get("rows", []):
        key = tuple(f"{k}={row[k]}" for k in KEYS if k in row)
        out[key] = {m: row[m] for m in METRICS if isinstance(row.get(m), (int, float))}
    return out


def main():
    a_ref, b_ref, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    args = sys.argv[sys.argv.index("--") + 1:]
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"A": checkout(a_ref, Path(tmp)), "B": checkout(b_ref, Path(tmp))}
        seen = {"A": [], "B": []}
        try:
            for i in range(rounds):
                for arm in ("A", "B") if i % 2 == 0 else ("B", "A"):
                    seen[arm].append(rows(run(trees[arm], args)))
                    print(f"round {i + 1}/{rounds} {arm} done", file=sys.stderr, flush=True)
        finally:
            for tree in trees.values():
                if tree != ROOT:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                                   capture_output=True)
    print(f"A = {a_ref}, B = {b_ref}; {rounds} interleaved rounds of `justfit bench {' '.join(args)}`; "
          f"load average now {os.getloadavg()[0]:.2f}")
    print("| row | metric | A median (min-max) | B median (min-max) | B/A |")
    print("| --- | --- | --- | --- | --- |")
    for key in seen["A"][0]:
        for metric in seen["A"][0][key]:
            va = [r[key][metric] for r in seen["A"] if metric in r.get(key, {})]
            vb = [r[key][metric] for r in seen["B"] if metric in r.get(key, {})]
            if not va or not vb:
                continue
            ma, mb = statistics.median(va), statistics.median(vb)
            print(f"| {' '.join(key)} | {metric} | {ma:.4g} ({min(va):.4g}-{max(va):.4g}) | "
                  f"{mb:.4g} ({min(vb):.4g}-{max(vb):.4g}) | {mb / ma if ma else float('nan'):.3f} |")


if __name__ == "__main__":
    main()
