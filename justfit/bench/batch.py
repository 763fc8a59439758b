"""`justfit bench batch`: many requests on one model, JustFit's batching scheduler vs mlx-lm's BatchGenerator.

Workload: `concurrency` requests submitted at once, each `prompt_tokens` random token ids of which the first
`shared` (at most half the prompt) are one system prefix common to all (fresh random tokens every round, so no system starts warm),
`gen` greedy tokens each with end-of-turn ids ignored (every request generates exactly `gen`). Systems run
in the same process on the same model and inputs, alternating order every round: `justfit` (scheduler.Engine,
default KV config, paged pool + prefix index in a temporary home) and `mlx-lm-batch` (BatchGenerator, its own
left-padded KVCache per row). Timing rows are medians over rounds with min and max.
`--wide` swaps the default model for a random-weight llama with a 7-8B model's attention shapes (hidden
4096, 32 query heads, 8 KV heads, head_dim 128, FFN 14336) cut to `--wide-layers` layers, for long contexts.
Capacity rows: how many concurrent sequences of `capacity_tokens` tokens (and how many cached positions)
each system's KV layout holds under `budget` bytes, unrelated and sharing the workload's prefix (whole pages
of it); JustFit's arithmetic is checked against the pool bytes of real sequences forked from one prefix.
"""

import json
import sys
import tempfile
import time
from pathlib import Path

import typer

from .baseline import mlx_lm_layout
from .stats import percentile, spread


def _log(msg: str):
    print(msg, file=sys.stderr, flush=True)


def _timings(t0, token_times):
    """throughput-independent latency fields from per-request token timestamps."""
    ttft = [ts[0] - t0 for ts in token_times if ts]
    itl = [b - a for ts in token_times for a, b in zip(ts, ts[1:])]
    return {"ttft_p50_s": percentile(ttft, 0.5, 0.0), "ttft_p99_s": percentile(ttft, 0.99, 0.0),
            "itl_p50_s": percentile(itl, 0.5, 0.0), "itl_p99_s": percentile(itl, 0.99, 0.0)}


def _prompts(rng, concurrency, prompt_tokens, shared, vocab):
    prefix = [rng.randrange(1000, vocab) for _ in range(shared)]
    return [prefix + [rng.randrange(1000, vocab) for _ in range(prompt_tokens - shared)] for _ in range(concurrency)]


def run_justfit(model, tokenizer, kv, home, prompts, gen):
    """All prompts submitted at once to a fresh Engine over a fresh pool and prefix index."""
    import mlx.core as mx

    from justfit.engine import Engine
    from justfit.statetrans.index import make_index

    index = make_index(model, tokenizer, kv, home)
    from justfit.kvexec import make_cache

    eng = Engine(model, tokenizer, lambda: make_cache(model, kv, pool=index.pool), index=index, kv=kv, eos=set())
    mx.synchronize()
    mx.reset_peak_memory()
    start = mx.get_active_memory()  # weights and whatever else was resident before the run
    t0 = time.perf_counter()
    reqs = [eng.submit(p, max_tokens=gen) for p in prompts]
    eng.run(reqs)
    wall = time.perf_counter() - t0
    row = {"throughput_tok_s": sum(len(r.out) for r in reqs) / wall, "peak_memory_bytes": mx.get_peak_memory(),
           "peak_over_start_bytes": mx.get_peak_memory() - start,
           "prefilled_tokens": sum(r.stats.prefilled_tokens for r in reqs), "generated_tokens": sum(len(r.out) for r in reqs),
           "kv_bytes": index.pool.nbytes, "wall_s": wall}
    row.update(_timings(t0, [r.token_times for r in reqs]))
    return row


def run_mlx_lm(model, prompts, gen):
    """mlx-lm's BatchGenerator (no stop tokens: exactly `gen` tokens each), all prompts inserted at once,
    on the weights as mlx_lm.load lays them out."""
    with mlx_lm_layout(model):
        return _run_batch_generator(model, prompts, gen)


def _run_batch_generator(model, prompts, gen):
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    mx.synchronize()
    mx.reset_peak_memory()
    start = mx.get_active_memory()
    t0 = time.perf_counter()
    bg = BatchGenerator(model, max_tokens=gen, completion_batch_size=max(32, len(prompts)),
                        prefill_batch_size=max(8, len(prompts)))
    uids = bg.insert(prompts, [gen] * len(prompts))
    times = {u: [] for u in uids}
    left = set(uids)
    with bg.stats() as stats:
        while left:
            for r in bg.next_generated():
                times[r.uid].append(time.perf_counter())
                if r.finish_reason is not None:
                    left.discard(r.uid)
    wall = time.perf_counter() - t0
    bg.close()
    row = {"throughput_tok_s": sum(map(len, times.values())) / wall, "peak_memory_bytes": mx.get_peak_memory(),
           "peak_over_start_bytes": mx.get_peak_memory() - start,
           "prefilled_tokens": int(stats.prompt_tokens), "generated_tokens": sum(map(len, times.values())),
           "wall_s": wall}
    row.update(_timings(t0, list(times.values())))
    return row


def capacity_rows(model, kv, budget, tokens, shared):
    """Concurrent `tokens`-token sequences and cached positions each KV layout holds under `budget` bytes, for
    unrelated sequences and for sequences sharing a `shared`-token prefix (the batch workload's system prompt:
    JustFit holds its sealed pages once; mlx-lm's BatchGenerator keeps a full cache per row)."""
    from justfit.engine.kvbytes import KVBytes

    sizes = KVBytes(model, kv)
    P = kv.page_size
    common = min(shared, tokens // 2) // P * P  # only whole sealed pages are shared
    a = model.args
    heads = getattr(a, "num_key_value_heads", None) or a.num_attention_heads
    dim = getattr(a, "head_dim", None) or a.hidden_size // a.num_attention_heads
    layers = len(model.layers) if hasattr(model, "layers") else a.num_hidden_layers
    step = 256  # mlx-lm KVCache grows in steps of 256 positions, float32 on CPU
    mlx_per_seq = 2 * layers * heads * dim * 4 * (-(-tokens // step) * step)
    rows = []
    for prefix in sorted({0, common}):
        once = sizes.seq(prefix)  # the shared pages, held once
        for name, each, fixed in (("justfit", sizes.worst(tokens) - once, once), ("mlx-lm-batch", mlx_per_seq, 0)):
            n = max(0, budget - fixed) // each
            rows.append({"system": name, "budget_bytes": budget, "context": tokens, "shared_prefix_tokens": prefix,
                         "concurrency": int(n), "capacity_positions": int(n * tokens),
                         "kv_bytes_per_sequence": int(each), "kv_bytes_shared": int(fixed)})
    return rows, _capacity_check(model, kv, sizes)


def _capacity_check(model, kv, sizes) -> dict:
    """The page arithmetic against a real pool: two sequences of 3.5 pages forked from one 2-page prefix (a
    16-bit first page, sealed 4-bit pages, 16-bit open pages, as the scheduler runs them), measured vs predicted."""
    import mlx.core as mx

    from justfit.kvexec import fork_caches, make_cache

    P = kv.page_size
    prefix, tokens = 2 * P, 3 * P + P // 2
    base = make_cache(model, kv)
    for x in base:
        x.for_batch()
    model(mx.array([list(range(1000, 1000 + prefix))]), cache=base)
    mx.eval([x.state for x in base])
    for i in range(2):
        child = fork_caches(base)
        for x in child:
            x.for_batch()
        model(mx.array([list(range(2000 + i * P, 2000 + i * P + tokens - prefix))]), cache=child)
        mx.eval([x.state for x in child])
    predicted = sizes.seq(prefix) + 2 * (sizes.seq(tokens) - sizes.seq(prefix))
    return {"measured_bytes": int(base[0].seq.pool.nbytes), "predicted_bytes": int(predicted), "tokens": tokens,
            "prefix": prefix}


WIDE = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=14336,
            rope_theta=500000.0, rms_norm_eps=1e-5)  # Llama-3-8B's layer shapes


def wide_model(layers: int, vocab_size: int, ffn: int = WIDE["intermediate_size"]):
    """A random-weight float32 llama with 8B attention shapes and `layers` layers (weights made lazily)."""
    import mlx.core as mx
    from mlx_lm.models import llama

    mx.random.seed(0)
    args = llama.ModelArgs(model_type="llama", num_hidden_layers=layers, vocab_size=vocab_size,
                           tie_word_embeddings=True, **{**WIDE, "intermediate_size": ffn})
    model = llama.Model(args)
    model.justfit_path = f"random-llama-8b-shapes-{layers}-layers"
    return model


def _load(model_spec, wide_layers: int):
    from justfit.models import layout, load

    model, tokenizer = load(model_spec)
    if wide_layers:
        model = wide_model(wide_layers, int(model.args.vocab_size))  # the default model's tokenizer decodes it
        if layout.enabled():
            layout.row_major(model)  # as justfit.load lays out a real model of these shapes
    return model, tokenizer


def run(model_spec, concurrencies, prompt_lengths, shared, gen, rounds, budget, capacity_tokens, systems,
        wide_layers: int = 0):
    import random

    import mlx.core as mx
    import mlx_lm

    import justfit
    from justfit.config import KVConfig
    from justfit.kvexec.kernels import backend

    model, tokenizer = _load(model_spec, wide_layers)
    kv = KVConfig()
    vocab = int(model.args.vocab_size)
    rows = []
    with tempfile.TemporaryDirectory(prefix="justfit-bench-batch-") as tmp:
        home = Path(tmp)
        rng = random.Random(0)
        workloads = [(p, c) for p in prompt_lengths for c in concurrencies] if rounds else []  # 0: capacity only
        if workloads:
            _log("batch: warm-up")
            warm = _prompts(rng, 2, 64, 32, vocab)
            run_justfit(model, tokenizer, kv, home / "warm", warm, 4)
            run_mlx_lm(model, warm, 4)
        for prompt_tokens, conc in workloads:
            samples = {s: [] for s in systems}
            common = min(shared, prompt_tokens // 2)
            for i in range(rounds):
                prompts = _prompts(rng, conc, prompt_tokens, common, vocab)
                order = systems if i % 2 == 0 else systems[::-1]
                for s in order:
                    if s == "justfit":
                        r = run_justfit(model, tokenizer, kv, home / f"r{prompt_tokens}-{conc}-{i}", prompts, gen)
                    else:
                        r = run_mlx_lm(model, prompts, gen)
                    samples[s].append(r)
                    _log(f"batch: {s} p={prompt_tokens} c={conc} round {i + 1}: {r['throughput_tok_s']:.1f} tok/s, ttft p50 "
                         f"{r['ttft_p50_s']:.2f}s, itl p50 {r['itl_p50_s'] * 1e3:.0f} ms, prefilled {r['prefilled_tokens']}, "
                         f"peak {r['peak_memory_bytes'] / 2**20:.0f} MiB")
            for s in systems:
                rows.append(_median_row(s, conc, prompt_tokens, common, gen, samples[s]))
        capacity, check = capacity_rows(model, kv, budget, capacity_tokens, shared)
    return {
        "bench": "batch", "model": getattr(model, "justfit_path", model_spec), "backend": backend(),
        "versions": {"justfit": justfit.__version__, "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__},
        "kv": kv.name,
        "notes": {
            "workload": f"{'/'.join(map(str, prompt_lengths))}-token random-id prompts sharing a prefix of "
                        f"min({shared}, prompt/2) tokens (fresh each round), "
                        f"{gen} greedy tokens each, end-of-turn ignored; all requests submitted at once",
            "throughput_tok_s": "generated tokens / wall time from submission to the last token",
            "peak_memory_bytes": "mx.get_peak_memory() over the run: weights + KV + workspace",
            "peak_over_start_bytes": "peak minus the memory active at submission (the weights): KV + workspace",
            "layout": "mlx-lm-batch runs the weights in mlx-lm's layout (W [out, in]), justfit in JustFit's "
                      "(row-major on the CPU, models/layout.py)",
            "capacity": "layout arithmetic under budget_bytes (KV only), for unrelated sequences and for sequences "
                        "sharing the workload's prefix (shared_prefix_tokens, whole pages); justfit's page arithmetic "
                        f"checked against the pool bytes of two real {check['tokens']}-token sequences forked from "
                        f"one {check['prefix']}-token prefix: predicted {check['predicted_bytes']}, "
                        f"measured {check['measured_bytes']}",
        },
        "rows": rows + capacity,
    }


def _median_row(system, conc, prompt_tokens, shared, gen, samples):
    row = {"system": system, "concurrency": conc, "prompt_tokens": prompt_tokens, "shared_prefix_tokens": shared,
           "gen_tokens": gen, "rounds": len(samples)}
    for key in ("throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "peak_memory_bytes",
                "peak_over_start_bytes", "prefilled_tokens"):
        row.update(spread(key, [s[key] for s in samples]))
    return row


SYSTEMS = ("justfit", "mlx-lm-batch")


def batch(
    concurrency: str = typer.Option("1,4,8,16", "--concurrency", help="Comma-separated numbers of concurrent requests."),
    prompt_tokens: str = typer.Option("512,4096", "--prompt-tokens", help="Comma-separated tokens per prompt."),
    shared: int = typer.Option(1024, "--shared", help="Tokens of the prefix all prompts share (at most half a prompt), "
                               "in the timed workloads and the capacity rows."),
    gen: int = typer.Option(128, "--gen", help="Generated tokens per request."),
    rounds: int = typer.Option(3, "--rounds", help="Interleaved rounds per concurrency (median reported); 0: "
                               "capacity rows only (they count bytes, not time)."),
    budget: str = typer.Option("512MiB", "--budget", help="KV budget for the capacity rows."),
    capacity_tokens: int = typer.Option(4096, "--capacity-tokens", help="Sequence length for the capacity rows."),
    systems: str = typer.Option(",".join(SYSTEMS), "--systems", help="Comma-separated systems to run."),
    model: str = typer.Option("default", "--model", help="Model spec, as for justfit chat."),
    wide: bool = typer.Option(False, "--wide", help="A random-weight llama with 7-8B attention shapes instead."),
    wide_layers: int = typer.Option(2, "--wide-layers", help="Layers of the --wide model."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
):
    """Continuous batching: JustFit's scheduler vs mlx-lm's BatchGenerator (throughput, TTFT, ITL, memory, capacity)."""
    from justfit.errors import UserError
    from justfit.phaseswap.budget import parse_budget

    concs, lengths = _ints(concurrency, "--concurrency"), _ints(prompt_tokens, "--prompt-tokens")
    names = tuple(s.strip() for s in systems.split(",") if s.strip())
    if not concs or any(c < 1 for c in concs) or not names or any(n not in SYSTEMS for n in names):
        raise UserError(f"--concurrency must be positive and --systems among {', '.join(SYSTEMS)}")
    if not lengths or min(lengths) < 2 or gen < 1 or rounds < 0 or shared < 0 or wide_layers < 1:
        raise UserError("--prompt-tokens >= 2, --gen >= 1, --rounds >= 0, --shared >= 0 and --wide-layers >= 1")
    result = run(model, concs, lengths, shared, gen, rounds, parse_budget(budget), capacity_tokens, names,
                 wide_layers if wide else 0)
    if json_out:
        print(json.dumps(result))
        return
    for r in result["rows"]:
        if "capacity_positions" in r:
            print(f"{r['system']:14s} capacity under {r['budget_bytes'] / 2**20:.0f} MiB, shared prefix "
                  f"{r['shared_prefix_tokens']}: {r['concurrency']} x {r['context']} tokens = "
                  f"{r['capacity_positions']} positions")
        else:
            print(f"{r['system']:14s} p={r['prompt_tokens']:5d} c={r['concurrency']:3d}  {r['throughput_tok_s']:7.1f} tok/s  ttft p50 "
                  f"{r['ttft_p50_s']:.2f}s  itl p50 {r['itl_p50_s'] * 1e3:.0f} ms  peak "
                  f"{r['peak_memory_bytes'] / 2**20:.0f} MiB  prefilled {r['prefilled_tokens']}")


def _ints(text: str, option: str):
    from justfit.errors import UserError

    try:
        return [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise UserError(f"{option} must be comma-separated integers, not {text!r}") from None
