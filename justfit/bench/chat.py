"""`justfit bench chat`: one-shot chat turns, `rt.stream(prompt)` vs `mlx_lm.stream_generate`, interleaved.

Systems: `justfit` (the Runtime as `justfit chat` runs it), `mlx-lm` (mlx_lm.stream_generate on a float32 copy
of the weights in mlx-lm's layout: what JustFit's CPU path used to be and what mlx-lm's CPU users get after
dequantizing) and `mlx-lm-quantized` (mlx_lm.load's own model: the folder's quantized weights, MLX's
quantized_matmul). All get the same prompt text (the Runtime's chat template renders it; mlx-lm gets those
token ids) and greedy sampling. Each row names the weight and KV dtypes it ran and a bandwidth column
(bench/bandwidth.py: bytes read per generated token over a streaming-read bandwidth measured in this run). TTFT is the time from the call to the first token
yielded; decode tok/s is (tokens - 1) / (last token time - first token time); peak memory is MLX's peak
over the turn. Each round uses a fresh prompt (so no system reuses a previous round's prefix beyond
what the Runtime's own prefix cache does, reported as `reused_tokens`); systems alternate in each round.

`--context N` puts a document of about N tokens before each round's question (TTFT at long prompts;
shortened so that the prompt and --max-tokens fit the model's context); its words are shuffled per round
from a seed, so no round shares a prefix with another. `--systems` leaves
baselines out (mlx_lm.load's quantized path prefills at a few tokens per second on a CPU).
"""

import json
import statistics
import sys
import time

import typer

from . import bandwidth
from .stats import spread

PROMPTS = [
    "Describe how a lighthouse keeper might spend a stormy night, in about one hundred words.",
    "Explain, step by step, how to check whether a number is prime, then give a short Python function.",
    "Write a short letter from a gardener to a neighbour about a tree that grows over the fence.",
    "What are three things to consider when choosing a bicycle for commuting? Explain each briefly.",
    "Summarize the idea of supply and demand for someone who has never studied economics.",
    "Give a packing list for a two-day hike in autumn and say why each item matters.",
    "Tell a very short story about a robot who learns to bake bread.",
]


SYSTEMS = ("justfit", "mlx-lm", "mlx-lm-quantized")


def long_prompt(question: str, tokens: int, seed: int, encode) -> str:
    """`question` after a document of about `tokens` tokens: words of the bench's prompts in an order drawn
    from `seed`, cut to length by the tokenizer (`encode`)."""
    import random

    if tokens <= 0:
        return question
    words = " ".join(PROMPTS).split()
    rng = random.Random(seed)
    doc = []
    while len(doc) < tokens:
        doc.extend(rng.sample(words, len(words)))
    text = " ".join(doc)
    ids = encode(text)
    while len(ids) > tokens:  # whole words only: drop the surplus's share and re-measure
        doc = doc[: max(1, int(len(doc) * tokens / len(ids)) - 1)]
        text = " ".join(doc)
        ids = encode(text)
    return f"Read this document, then answer.\n\n{text}\n\n{question}"


def _fitted(rt, question: str, context: int, seed: int, max_tokens: int):
    """(prompt, ids) with a document of about `context` tokens, shortened so that the prompt and max_tokens
    fit the model's context (the engine refuses a longer prompt: the model was not trained past it)."""
    limit = rt.batch_engine().context
    prompt = long_prompt(question, context, seed=seed, encode=rt.encode)
    ids = rt.encode(prompt)
    if context and len(ids) + max_tokens > limit:
        prompt = long_prompt(question, context - (len(ids) + max_tokens - limit), seed=seed, encode=rt.encode)
        ids = rt.encode(prompt)
    return prompt, ids


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


def _timed(chunks):
    """(ttft_s, decode_tok_s, tokens) of an iterator of generated tokens started just now."""
    t0 = time.perf_counter()
    first = last = None
    n = 0
    for _ in chunks:
        last = time.perf_counter()
        first = first or last
        n += 1
    if first is None:
        return float("nan"), 0.0, 0
    return first - t0, (n - 1) / (last - first) if n > 1 and last > first else 0.0, n


def _justfit(rt, prompt, max_tokens):
    import mlx.core as mx

    mx.clear_cache()
    mx.reset_peak_memory()
    chunks = (c for c in rt.stream(prompt, max_tokens=max_tokens) if c.token >= 0)
    ttft, tps, n = _timed(chunks)
    stats = getattr(rt, "last_stats", None)  # TurnStats (engine) or a dict (before it)
    reused = stats.get("reused_tokens", 0) if isinstance(stats, dict) else getattr(stats, "reused_tokens", 0)
    return {"ttft_s": ttft, "decode_tok_s": tps, "tokens": n, "peak_memory_bytes": mx.get_peak_memory(),
            "reused_tokens": int(reused or 0)}


def _mlx_lm(model, tokenizer, ids, max_tokens):
    import mlx.core as mx
    from mlx_lm import stream_generate

    eos = set(tokenizer.eos_token_ids)
    mx.clear_cache()
    mx.reset_peak_memory()
    chunks = (r for r in stream_generate(model, tokenizer, ids, max_tokens=max_tokens) if r.token not in eos)
    ttft, tps, n = _timed(chunks)
    peak = mx.get_peak_memory()
    return {"ttft_s": ttft, "decode_tok_s": tps, "tokens": n, "peak_memory_bytes": peak,
            "reused_tokens": 0}


def _baselines(path, systems):
    """{name: model} of the mlx-lm systems asked for: a float32 copy in mlx-lm's layout, and mlx_lm.load's
    own model."""
    from mlx_lm.utils import load as mlx_load

    from justfit.models import layout, load, qlinear

    out = {}
    if "mlx-lm" in systems:
        fp32, _ = load(path, weights="fp32")
        layout.standard(fp32)
        qlinear.standard(fp32)
        out["mlx-lm"] = fp32
    if "mlx-lm-quantized" in systems:
        out["mlx-lm-quantized"] = mlx_load(path)[0]
    return out


def _dtypes(rt, models) -> dict:
    """{system: (weights, kv, kv bytes per element)}: what each row actually ran."""
    kv, dt = rt.kv, bandwidth.compute_dtype(rt.model)
    justfit_kv = f"{kv.bits}-bit {kv.format}" if kv.bits < 16 else str(dt).split(".")[-1]
    kv_elem = kv.bits / 8 + 4 / kv.group_size if kv.bits < 16 else dt.size
    weights = "as stored + qmm.c" if getattr(rt.model, "justfit_weights", "") == "quantized" else "float32"
    out = {"justfit": (weights, justfit_kv, kv_elem)}
    for name, m in models.items():
        dt = bandwidth.compute_dtype(m)
        out[name] = ("float32" if name == "mlx-lm" else "as stored", str(dt).split(".")[-1], dt.size)
    return out


def run(model_spec: str, rounds: int, max_tokens: int, context: int = 0, systems=SYSTEMS) -> dict:
    """The bench, with justfit's Runtime on a scratch home: it reuses prefixes within this run (reported as
    reused_tokens) but none that an earlier run stored."""
    from justfit.models import resolve

    from .scratch import scratch_home

    folder = resolve(model_spec)
    with scratch_home("justfit-bench-chat-") as home:
        return _run(folder, home, rounds, max_tokens, context, systems)


def _run(folder, home, rounds: int, max_tokens: int, context: int, systems) -> dict:
    import os

    import mlx.core as mx
    import mlx_lm

    import justfit
    from justfit.models.load import backend

    rt = justfit.Runtime(folder, home=home)
    tokenizer = rt.tokenizer
    models = _baselines(rt.model.justfit_path, systems)
    dtypes = _dtypes(rt, models)
    stream_bw = bandwidth.stream_read_bandwidth()
    load_start = [round(x, 2) for x in os.getloadavg()]
    _justfit(rt, "Hello.", 4)  # warm-up, excluded
    for m in models.values():
        _mlx_lm(m, tokenizer, rt.encode("Hello."), 4)
    per = {name: [] for name in systems}
    for r in range(rounds):
        question = PROMPTS[r % len(PROMPTS)] + ("" if r < len(PROMPTS) else f" (variant {r})")
        prompt, ids = _fitted(rt, question, context, r, max_tokens)
        order = list(per) if r % 2 == 0 else list(per)[::-1]
        for name in order:
            res = _justfit(rt, prompt, max_tokens) if name == "justfit" else _mlx_lm(models[name], tokenizer, ids, max_tokens)
            res["prompt_tokens"] = len(ids)
            per[name].append(res)
            _log(f"chat: round {r + 1} {name}: ttft {res['ttft_s'] * 1000:.0f} ms, decode {res['decode_tok_s']:.1f} tok/s, "
                 f"{res['tokens']} tokens, peak {res['peak_memory_bytes'] / 2**20:.0f} MiB")
    rows = []
    for name, rs in per.items():
        weights_dtype, kv_dtype, kv_elem = dtypes[name]
        row = {"system": name, "weights": weights_dtype, "kv": kv_dtype, "rounds": rounds, "max_tokens": max_tokens,
               "prompt_tokens": statistics.median(x["prompt_tokens"] for x in rs),
               "generated_tokens": statistics.median(x["tokens"] for x in rs),
               "reused_tokens": statistics.median(x["reused_tokens"] for x in rs)}
        for key in ("ttft_s", "decode_tok_s", "peak_memory_bytes"):
            row.update(spread(key, [x[key] for x in rs]))
        model = rt.model if name == "justfit" else models[name]
        mean_context = row["prompt_tokens"] + row["generated_tokens"] / 2
        row.update(bandwidth.columns(bandwidth.weight_bytes(model), bandwidth.kv_bytes_per_token(model, kv_elem),
                                     mean_context, row["decode_tok_s"], stream_bw))
        rows.append(row)
    return {"bench": "chat", "model": getattr(rt.model, "justfit_path", str(folder)), "backend": backend(),
            "versions": {"justfit": justfit.__version__, "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__},
            "default_kv": vars(rt.kv), "load_average": {"start": load_start, "end": [round(x, 2) for x in os.getloadavg()]},
            "context": context,
            "notes": {"timing": f"median of {rounds} interleaved rounds, fresh prompt per round, greedy, _min/_max",
                      "justfit": "Runtime.stream(prompt): the path of `justfit chat` (default KVConfig, prefix reuse on, "
                                 "on a scratch home: no prefix stored by an earlier run)",
                      "mlx-lm": "mlx_lm.stream_generate on the same token ids, its default KVCache, a float32 copy of "
                                "the weights in mlx-lm's layout (W [out, in])",
                      "mlx-lm-quantized": "mlx_lm.stream_generate on mlx_lm.load's own model (the folder's weights)",
                      "bandwidth": "bytes_per_token: weights as held + KV at the turn's mean context; bandwidth_pct: "
                                   "decode tok/s x bytes_per_token over a 256 MiB streaming read measured in this run"},
            "rows": rows}


def chat(
    rounds: int = typer.Option(5, "--rounds", help="Interleaved rounds (median, min, max)."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="Tokens generated per turn."),
    model: str = typer.Option("default", "--model", help="Model spec, as for justfit chat."),
    context: int = typer.Option(0, "--context", help="Tokens of document before each question (0: the short "
                                "prompts alone), shortened where the prompt and --max-tokens would pass the model's "
                                "context. TTFT at 512 to 8k tokens is the long-prompt target."),
    systems: str = typer.Option(",".join(SYSTEMS), "--systems",
                                help="Comma-separated systems to run: justfit, mlx-lm, mlx-lm-quantized."),
    quick: bool = typer.Option(False, "--quick", help="CI smoke: 2 rounds of 8 tokens."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
):
    """One-shot chat turns: TTFT, decode tok/s and peak memory of justfit's chat path vs mlx_lm.stream_generate."""
    from justfit.errors import UserError

    if quick:
        rounds, max_tokens = 2, 8
    if rounds < 1 or max_tokens < 2:
        raise UserError("--rounds must be at least 1 and --max-tokens at least 2")
    if context < 0:
        raise UserError("--context must be 0 or more tokens")
    chosen = tuple(x.strip() for x in systems.split(",") if x.strip())
    unknown = sorted(set(chosen) - set(SYSTEMS))
    if unknown or "justfit" not in chosen:
        raise UserError(f"--systems takes justfit (always) and any of mlx-lm, mlx-lm-quantized; got {systems!r}")
    result = run(model, rounds, max_tokens, context, chosen)
    if json_out:
        print(json.dumps(result))
        return
    print(f"load {result['load_average']}")
    for r in result["rows"]:
        print(f"{r['system']:16s} ttft {r['ttft_s'] * 1000:7.0f} ms [{r['ttft_s_min'] * 1000:.0f}-{r['ttft_s_max'] * 1000:.0f}]  "
              f"decode {r['decode_tok_s']:6.1f} tok/s [{r['decode_tok_s_min']:.1f}-{r['decode_tok_s_max']:.1f}]  "
              f"peak {r['peak_memory_bytes'] / 2**20:6.0f} MiB  prompt {r['prompt_tokens']:.0f} tokens  "
              f"{r['bandwidth_pct']:.0f}% of bandwidth  weights {r['weights']}, kv {r['kv']}")
