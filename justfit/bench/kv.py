"""`justfit bench kv`: KVExec's paged caches against mlx-lm's KVCache / QuantizedKVCache, same process.

Rows per (system, context): decode_tok_s and kv_bytes on the full default model with caches filled by
synthetic K/V (a long prefill per system is too slow on a CPU), and prefill_tok_s / peak_memory_bytes
of a real chunked prefill on the default model cut to its first `--prefill-layers` layers (same
attention shapes). Quality rows: see kv_quality.py. One JSON object on stdout with --json.
"""

import json
import sys
import time
from typing import Optional

import typer

SYSTEM_NAMES = ["mlx-lm-fp16", "mlx-lm-q4", "justfit-fp16", "justfit-q4-affine", "justfit-q4-rotated"]
CHUNK = 2048  # prefill chunk for every system (mlx-lm's default prefill_step_size)


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


def _factory(name: str, model, page_size: int = 256, sinks: int = 0):
    """A function making fresh per-layer caches of one system for `model`."""
    from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

    from justfit.config import KVConfig
    from justfit.kvexec import make_cache

    if name == "mlx-lm-fp16":
        return lambda: make_prompt_cache(model)
    if name == "mlx-lm-q4":
        return lambda: [QuantizedKVCache(group_size=64, bits=4) for _ in model.layers]
    common = dict(page_size=page_size, quantized_kv_start=sinks)
    kv = {"justfit-fp16": KVConfig(bits=16, **common),
          "justfit-q4-affine": KVConfig(bits=4, format="affine", **common),
          "justfit-q4-rotated": KVConfig(bits=4, format="rotated", **common)}[name]
    return lambda: make_cache(model, kv)


def _attention_shape(model):
    attn = model.layers[0].self_attn
    return attn.n_kv_heads, attn.head_dim


def _fill_synthetic(caches, model, context: int, seed: int = 0):
    """Write `context` tokens of random K/V (same values for every system) into each layer's cache."""
    import mlx.core as mx

    H, D = _attention_shape(model)
    for i, c in enumerate(caches):
        key = mx.random.key(seed + i)
        k = mx.random.normal((1, H, context, D), key=key)
        v = mx.random.normal((1, H, context, D), key=mx.random.split(key)[0])
        c.update_and_fetch(k, v)
        mx.eval([a for a in _state(c)])


def _state(c):
    s = c.state
    flat = []
    for a in s if isinstance(s, (list, tuple)) else [s]:
        if isinstance(a, (list, tuple)):
            flat.extend(x for x in a if hasattr(x, "nbytes"))
        elif hasattr(a, "nbytes"):
            flat.append(a)
    return flat


def decode_row(model, make, context: int, steps: int):
    """decode_tok_s with a synthetic `context`-token cache, and that cache's kv_bytes."""
    import mlx.core as mx

    caches = make()
    _fill_synthetic(caches, model, context)
    token = mx.array([[42]])
    for _ in range(2):  # warm up (and JIT-compile fused kernels)
        mx.eval(model(token, cache=caches))
    t0 = time.perf_counter()
    for _ in range(steps):
        logits = model(token, cache=caches)
        token = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(token)
    dt = time.perf_counter() - t0
    kv_bytes = sum(c.nbytes for c in caches)
    del caches
    return {"decode_tok_s": steps / dt, "kv_bytes": int(kv_bytes)}


def prefill_row(model, make, context: int):
    """prefill_tok_s and peak_memory_bytes of a chunked prefill of `context` tokens (cut model)."""
    import mlx.core as mx

    tokens = mx.random.randint(100, 40000, (context,), key=mx.random.key(context))
    caches = make()
    mx.eval(tokens)
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    t0 = time.perf_counter()
    for i in range(0, context, CHUNK):
        model(tokens[i : i + CHUNK][None], cache=caches)  # logits stay lazy, as in mlx-lm's prefill
        mx.eval([_state(c) for c in caches])
    dt = time.perf_counter() - t0
    peak = mx.get_peak_memory()
    del caches
    mx.clear_cache()
    return {"prefill_tok_s": context / dt, "peak_memory_bytes": int(peak), "peak_over_start_bytes": int(peak - base)}


class _Cut:
    """Temporarily keep only the first n transformer layers of an mlx-lm model."""

    def __init__(self, model, n):
        self.inner, self.n = model.model, n

    def __enter__(self):
        self.saved = self.inner.layers
        self.inner.layers = self.saved[: self.n]

    def __exit__(self, *exc):
        self.inner.layers = self.saved


def run(model_spec: str, contexts, steps: int, prefill_layers: int, prompts: int, tokens: int,
        stress_page: Optional[int], systems) -> dict:
    import mlx.core as mx
    import mlx_lm

    import justfit
    from justfit.models.load import backend

    from . import kv_quality

    model, tokenizer = justfit.load(model_spec)
    rows = []
    for ci, ctx in enumerate(contexts):
        order = systems[ci % len(systems):] + systems[: ci % len(systems)]  # alternate who goes first
        for name in order:
            row = {"system": name, "context": ctx, "fill": "synthetic", "decode_steps": steps}
            row.update(decode_row(model, _factory(name, model), ctx, steps))
            with _Cut(model, prefill_layers):
                row.update(prefill_row(model, _factory(name, model), ctx))
            row["prefill_layers"] = prefill_layers
            rows.append(row)
            _log(f"kv: {name} ctx {ctx}: decode {row['decode_tok_s']:.2f} tok/s, kv {row['kv_bytes'] / 2**20:.1f} MiB, "
                 f"prefill {row['prefill_tok_s']:.1f} tok/s, peak {row['peak_memory_bytes'] / 2**20:.0f} MiB")
    quality = []
    if prompts > 0:
        refs = kv_quality.reference(model, tokenizer, prompts, tokens)
        qsys = [(n, None if n.startswith("mlx-lm") else (256, 0), None if n == "mlx-lm-fp16" else _factory(n, model))
                for n in systems]
        if stress_page:  # small pages: the format itself, without (0) and with (one page) full-precision sinks
            qsys += [(n, (stress_page, sinks), _factory(n, model, stress_page, sinks))
                     for sinks in (0, stress_page) for n in systems if n.startswith("justfit-q4")]
        quality = kv_quality.quality_rows(model, refs, qsys)
    return {
        "bench": "kv", "model": getattr(model, "justfit_path", model_spec), "backend": backend(),
        "versions": {"justfit": justfit.__version__, "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__},
        "notes": {
            "decode": "decode_tok_s and kv_bytes: full model, caches filled with synthetic random K/V to `context` tokens",
            "prefill": f"prefill_tok_s and peak_memory_bytes: real chunked prefill ({CHUNK}-token chunks) of random "
                       f"tokens on the model cut to its first {prefill_layers} layers (same attention shapes)",
            "quality": "teacher-forced replay of fp16 greedy trajectories through each cache's decode path; "
                       "rows with page_size 32 stress the quantized format (only the last <32 tokens stay full precision); "
                       "quantized_kv_start > 0 keeps those first tokens (attention sinks, system prompt) full precision",
            "mlx-lm-fp16": "mlx-lm KVCache in the model's compute dtype (float32 on CPU)",
        },
        "rows": rows,
        "quality": quality,
    }


def kv(
    contexts: str = typer.Option("1024,4096,16384", "--contexts", help="Comma-separated context lengths."),
    steps: int = typer.Option(8, "--steps", help="Timed decode steps per row."),
    prefill_layers: int = typer.Option(2, "--prefill-layers", help="Layers of the model used for prefill rows."),
    prompts: int = typer.Option(20, "--prompts", help="Held-out chat prompts for quality rows (0 skips them)."),
    tokens: int = typer.Option(64, "--tokens", help="Greedy trajectory length per prompt."),
    stress_page: int = typer.Option(32, "--stress-page", help="Extra quality rows at this page size (0: none)."),
    systems: str = typer.Option(",".join(SYSTEM_NAMES), "--systems", help="Comma-separated systems to run."),
    model: str = typer.Option("default", "--model", help="Model spec, as for justfit chat."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
):
    """Paged KV (fp16 / 4-bit affine / 4-bit rotated) vs mlx-lm KV caches: decode, prefill memory, quality."""
    from justfit.errors import UserError

    try:
        ctxs = [int(c) for c in contexts.split(",") if c.strip()]
    except ValueError:
        raise UserError(f"--contexts must be comma-separated integers, not {contexts!r}") from None
    names = [s.strip() for s in systems.split(",") if s.strip()]
    unknown = [n for n in names if n not in SYSTEM_NAMES]
    if unknown or not names or any(c <= 0 for c in ctxs):
        raise UserError(f"--systems must be among {', '.join(SYSTEM_NAMES)} and contexts positive")
    result = run(model, ctxs, steps, prefill_layers, prompts, tokens, stress_page or None, names)
    if json_out:
        print(json.dumps(result))
    else:
        for r in result["rows"]:
            print(f"{r['system']:20s} ctx {r['context']:6d}  decode {r['decode_tok_s']:7.2f} tok/s  "
                  f"kv {r['kv_bytes'] / 2**20:8.1f} MiB  prefill {r['prefill_tok_s']:7.1f} tok/s  "
                  f"peak {r['peak_memory_bytes'] / 2**20:7.0f} MiB")
        for q in result["quality"]:
            print(f"{q['system']:20s} page {q.get('page_size', '-')!s:4s} top1 {q['top1']:.3f}  kl {q['kl']:.4f}  "
                  f"ppl {q['ppl']:.3f} (fp16 {q['ppl_fp16']:.3f})  agreement {q['agreement']:.3f}")
