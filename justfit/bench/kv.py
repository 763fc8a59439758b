"""`justfit bench kv`: KVExec's paged caches against mlx-lm's KVCache / QuantizedKVCache, same process.

Every timing is the median of `--rounds` interleaved rounds (systems alternate inside each round, the
order rotating from round to round; caches are built once per context, warm-up excluded), with `_min` /
`_max`. Row kinds (`kind` field):
- `decode`: full default model, caches filled to `context` with the same synthetic K/V for every system;
- `prefill`: real chunked prefill of random tokens, on the full model up to `--full-prefill-max` tokens
  and on the model cut to `--prefill-layers` layers above it (long-context time and peak memory);
- `capacity`: longest context whose KV bytes (measured per page/position on a real cache) plus the
  attention workspace (prefill peak over KV of one layer whose output is evaluated, at two contexts,
  extrapolated linearly; measured at each step when the answer lies below them) fit `budget_bytes`,
  found by binary search.
Quality rows: kv_quality.py. One JSON object on stdout with --json.
"""

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from . import bandwidth
from .baseline import layout_for
from .stats import spread

SYSTEM_NAMES = ["mlx-lm-fp16", "mlx-lm-q4", "mlx-lm-q8", "justfit-fp16", "justfit-default", "justfit-q4-affine",
                "justfit-q4-rotated", "justfit-q4-g32", "justfit-q4-rotkeys", "justfit-q4-rotkeys-g32", "justfit-k8v4",
                "justfit-q4-chkeys", "justfit-q4-chkeys-g32", "justfit-nowindow"]
DEFAULT_SYSTEMS = ["mlx-lm-fp16", "mlx-lm-q4", "justfit-fp16", "justfit-default"]
CHUNK = 2048  # prefill chunk for every system (mlx-lm's default prefill_step_size)
BUDGETS = (256 << 20, 1 << 30)


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


def kv_config(name: str, page_size: Optional[int] = None, sinks: Optional[int] = None):
    """The KVConfig of a justfit system: the default one, or the default with bits/format changed."""
    from dataclasses import replace

    from justfit.config import KVConfig

    base = {"justfit-default": KVConfig(), "justfit-fp16": KVConfig(bits=16),
            "justfit-q4-affine": KVConfig(bits=4, format="affine", key_format="affine"),
            "justfit-q4-rotated": KVConfig(bits=4, format="rotated"),
            "justfit-q4-g32": KVConfig(bits=4, format="affine", key_format="affine", group_size=32),
            "justfit-q4-rotkeys": KVConfig(bits=4, format="affine", key_format="rotated"),
            "justfit-q4-rotkeys-g32": KVConfig(bits=4, format="affine", key_format="rotated", group_size=32),
            "justfit-k8v4": KVConfig(bits=4, format="affine", key_format="affine", key_bits=8),
            "justfit-q4-chkeys": KVConfig(bits=4, format="affine", key_format="channel"),
            "justfit-q4-chkeys-g32": KVConfig(bits=4, format="affine", key_format="channel", group_size=32),
            "justfit-nowindow": KVConfig(float_pages=0)}[name]  # the default without its float window
    if page_size is not None:
        base = replace(base, page_size=page_size)
    if sinks is not None:
        base = replace(base, quantized_kv_start=sinks)
    return base


def _factory(name: str, model, page_size: Optional[int] = None, sinks: Optional[int] = None):
    """A function making fresh per-layer caches of one system for `model`."""
    from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

    from justfit.kvexec import make_cache

    if name == "mlx-lm-fp16":
        return lambda: make_prompt_cache(model)
    if name in ("mlx-lm-q4", "mlx-lm-q8"):
        bits = int(name[-1])
        return lambda: [QuantizedKVCache(group_size=64, bits=bits) for _ in model.layers]
    kv = kv_config(name, page_size, sinks)
    return lambda: make_cache(model, kv)


def _attention_shape(model):
    attn = model.layers[0].self_attn
    return attn.n_kv_heads, attn.head_dim


def _fill_synthetic(caches, model, context: int, seed: int = 0):
    """Write `context` tokens of random K/V (same values for every system) into each layer's cache."""
    import mlx.core as mx

    from justfit.kvexec import PagedKVCache

    H, D = _attention_shape(model)
    for i, c in enumerate(caches):
        key = mx.random.key(seed + i)
        k = mx.random.normal((1, H, context, D), key=key)
        v = mx.random.normal((1, H, context, D), key=mx.random.split(key)[0])
        c.update_and_fetch(k, v)
        if isinstance(c, PagedKVCache):
            c.settle_window()  # as attention does after a chunk: float copies of the last page only
        mx.eval(_state(c))


def _state(c):
    s = c.state
    flat = []
    for a in s if isinstance(s, (list, tuple)) else [s]:
        if isinstance(a, (list, tuple)):
            flat.extend(x for x in a if hasattr(x, "nbytes"))
        elif hasattr(a, "nbytes"):
            flat.append(a)
    return flat


def _order(names, r):
    return names[r % len(names):] + names[: r % len(names)]


def _nbytes(caches) -> int:
    return int(sum(a.nbytes for c in caches for a in _state(c)))


def decode_rows(model, systems, context: int, steps: int, rounds: int):
    """decode_tok_s per system at `context` (synthetic fill once, `rounds` interleaved rounds of `steps` steps)."""
    import mlx.core as mx

    caches = {}
    for name in systems:
        caches[name] = _factory(name, model)()
        _fill_synthetic(caches[name], model, context)
    kv_bytes = {n: _nbytes(c) for n, c in caches.items()}
    token = mx.array([[42]])
    for c in caches.values():  # warm-up (and JIT-compile fused kernels), excluded
        mx.eval(model(token, cache=c))
    times = {n: [] for n in systems}
    for r in range(rounds):
        for name in _order(systems, r):
            c, tok = caches[name], token
            with layout_for(name, model):
                t0 = time.perf_counter()
                for _ in range(steps):
                    tok = mx.argmax(model(tok, cache=c)[:, -1:], axis=-1)
                    mx.eval(tok)
                times[name].append(steps / (time.perf_counter() - t0))
            for layer in c:  # back to `context` so every round times the same length
                layer.trim(steps)
    del caches
    mx.clear_cache()
    return [{"kind": "decode", "system": n, "context": context, "fill": "synthetic", "decode_steps": steps,
             "rounds": rounds, "kv_bytes": kv_bytes[n], **spread("decode_tok_s", times[n])} for n in systems]


def _prefill_once(model, make, tokens, through: bool = False):
    """(tok/s, peak, peak over start, KV bytes) of one chunked prefill with fresh caches. As in mlx-lm's
    prefill only the caches are evaluated, so the last layer's attention output is never computed; with
    `through` each chunk's hidden states are evaluated too (a one-layer cut then runs its attention)."""
    import mlx.core as mx

    caches = make()
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    t0 = time.perf_counter()
    for i in range(0, tokens.size, CHUNK):
        chunk = tokens[i : i + CHUNK][None]
        if through:
            mx.eval(model.model(chunk, cache=caches), _state_all(caches))  # hidden states, not logits (as _Cut)
            continue
        model(chunk, cache=caches)  # logits stay lazy, as in mlx-lm's prefill
        mx.eval(_state_all(caches))
    dt = time.perf_counter() - t0
    peak = mx.get_peak_memory()
    kv = _nbytes(caches)
    del caches
    mx.clear_cache()
    return tokens.size / dt, peak, peak - base, kv


def _state_all(caches):
    return [a for c in caches for a in _state(c)]


def prefill_rows(model, systems, context: int, rounds: int, layers: Optional[int]):
    """prefill_tok_s and peak memory per system: `rounds` interleaved real chunked prefills of random tokens."""
    import mlx.core as mx

    tokens = mx.random.randint(100, 40000, (context,), key=mx.random.key(context))
    mx.eval(tokens)
    tps = {n: [] for n in systems}
    peak, over, kv = {}, {}, {}
    with _Cut(model, layers):
        makes = {n: _factory(n, model) for n in systems}
        _prefill_once(model, makes[systems[0]], tokens[: min(context, 64)])  # warm-up, excluded
        for r in range(rounds):
            for name in _order(systems, r):
                with layout_for(name, model):
                    t, p, o, k = _prefill_once(model, makes[name], tokens)
                tps[name].append(t)
                peak.setdefault(name, []).append(p)
                over.setdefault(name, []).append(o)
                kv[name] = k
    n_layers = layers or len(model.layers)
    return [{"kind": "prefill", "system": n, "context": context, "prefill_layers": n_layers, "rounds": rounds,
             "peak_memory_bytes": int(statistics.median(peak[n])),
             "peak_over_start_bytes": int(statistics.median(over[n])), "kv_bytes": int(kv[n]),
             **spread("prefill_tok_s", tps[n])} for n in systems]


def capacity_rows(model, systems, budgets, probe=(4096, 8192)):
    """Longest context per system whose KV (full model) + attention workspace fits each budget (binary search)."""
    n_layers = len(model.layers)
    float32_cache = bandwidth.compute_dtype(model).size == 4  # a CPU: mlx-lm-fp16 holds float32
    rows = []
    for name in systems:
        make = _factory(name, model)
        with _Cut(model, 1):  # one layer: its KV bytes per position and its prefill workspace
            work = [_workspace(model, make, ctx) for ctx in probe]
            kv_at = [_kv_bytes(model, make, ctx) for ctx in probe]
            per_position = (kv_at[1] - kv_at[0]) / (probe[1] - probe[0])
            fixed = kv_at[0] - per_position * probe[0]
            seen = {}  # workspace measured at n positions, shared by this system's searches (and its 16-bit row)
            for budget in budgets:
                row = _capacity_row(name, model, make, n_layers, per_position, fixed, work, probe, budget, seen)
                rows.append(row)
                _log(f"kv: capacity {name} @ {budget / 2**20:.0f} MiB: {row['capacity_positions']} positions")
                if name == "mlx-lm-fp16" and float32_cache:
                    # mlx-lm's float KVCache as a 16-bit model (a Mac) holds it: half the KV bytes, same workspace
                    half = _capacity_row("mlx-lm-16bit", model, make, n_layers, per_position / 2, fixed / 2, work,
                                         probe, budget, seen)
                    rows.append({**half, "derived_from": "mlx-lm-fp16"})
    return rows


def _capacity_row(name, model, make, n_layers: int, per_position: float, fixed: float, work, probe, budget,
                  seen: dict) -> dict:
    """Longest context whose full-model KV (per layer: per_position bytes a position plus `fixed`) and prefill
    workspace fit `budget`: extrapolated from the probes' workspaces, measured by real prefills below the
    first probe (each length once: `seen` keeps them, so rows that share a cache factory search the same
    workspaces and a smaller KV never finds a shorter context)."""
    kv_need = _kv_need(n_layers, per_position, fixed)
    lo, measured = _longest(_with_workspace(kv_need, work, probe), budget), False
    if lo < probe[0]:  # below the probes the workspace is not extrapolated: measure it at each step
        lo, measured = _longest(_measured_need(model, make, kv_need, seen), budget, hi=probe[0]), True
    return {"kind": "capacity", "system": name, "budget_bytes": int(budget), "capacity_positions": lo,
            "kv_only_positions": _longest(kv_need, budget), "kv_bytes_per_position": n_layers * per_position,
            "kv_fixed_bytes": n_layers * fixed, "workspace_bytes_at_probe": work, "workspace_probe_contexts": list(probe),
            "workspace_measured_in_search": measured, "positions_per_gib": lo * (1 << 30) / budget}


def _measured_need(model, make, kv_need, seen: dict):
    """KV bytes plus the workspace of a real one-layer prefill at n positions (within a one-layer cut),
    measured once per n."""

    def need(n):
        if n not in seen:
            seen[n] = _workspace(model, make, n)
        return kv_need(n) + seen[n]

    return need


def _workspace(model, make, ctx: int) -> int:
    """Prefill peak over start minus KV bytes of one real prefill of `ctx` random tokens, attention evaluated."""
    import mlx.core as mx

    if ctx <= 0:
        return 0
    tokens = mx.random.randint(100, 40000, (ctx,), key=mx.random.key(ctx))
    _, _, over, kv = _prefill_once(model, make, tokens, through=True)
    return max(0, over - kv)


def _kv_bytes(model, make, ctx: int) -> int:
    """Bytes of fresh caches filled with `ctx` synthetic positions."""
    caches = make()
    _fill_synthetic(caches, model, ctx)
    return _nbytes(caches)


def _kv_need(n_layers, per_position, fixed):
    """KV bytes of n positions on the full model (per layer: per-position bytes plus a fixed first page)."""
    return lambda n: n_layers * (per_position * n + fixed)


def _with_workspace(kv_need, work, probe):
    """KV plus prefill workspace at n positions: a workspace that grows between the probes grows linearly
    from the first probe on (below it, the first probe's); a bounded one costs its larger probe."""
    slope = (work[1] - work[0]) / (probe[1] - probe[0])
    if slope <= 0:
        return lambda n: kv_need(n) + max(work)
    return lambda n: kv_need(n) + work[0] + slope * max(0, n - probe[0])


def _longest(need, budget, hi: int = 1 << 24) -> int:
    """The largest n (binary search up to `hi`) with need(n) <= budget; 0 when none fits."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if need(mid) <= budget else (lo, mid - 1)
    return lo


class _Cut:
    """Temporarily keep only the first n transformer layers of an mlx-lm model (None: all of them)."""

    def __init__(self, model, n):
        self.inner, self.n = model.model, n

    def __enter__(self):
        self.saved = self.inner.layers
        if self.n:
            self.inner.layers = self.saved[: self.n]

    def __exit__(self, *exc):
        self.inner.layers = self.saved


def _load():
    """uptime load averages, to print next to timings (the machine may be shared)."""
    import os

    return [round(x, 2) for x in os.getloadavg()]


def run(model_spec: str, contexts, steps: int, rounds: int, full_prefill_max: int, prefill_layers: int,
        prompts: int, tokens: int, stress_page: Optional[int], systems, budgets, document: bool,
        probe=(4096, 8192), chat: bool = True, document_text: Optional[str] = None, document_tokens: int = 2048) -> dict:
    import mlx.core as mx
    import mlx_lm

    import justfit
    from justfit.config import KVConfig
    from justfit.models.load import backend

    from . import kv_quality

    model, tokenizer = justfit.load(model_spec)
    load_start = _load()
    stream_bw = bandwidth.stream_read_bandwidth() if contexts else None
    weights = bandwidth.weight_bytes(model)
    rows = []
    for ctx in contexts:
        for r in decode_rows(model, systems, ctx, steps, rounds):
            r.update(bandwidth.columns(weights, r["kv_bytes"] / ctx, ctx, r["decode_tok_s"], stream_bw))
            rows.append(r)
            _log(f"kv: decode {r['system']} ctx {ctx}: {r['decode_tok_s']:.2f} tok/s "
                 f"[{r['decode_tok_s_min']:.2f}-{r['decode_tok_s_max']:.2f}], kv {r['kv_bytes'] / 2**20:.1f} MiB, "
                 f"{r['bandwidth_pct']:.0f}% of bandwidth")
        layers = None if ctx <= full_prefill_max else prefill_layers
        for r in prefill_rows(model, systems, ctx, rounds, layers):
            rows.append(r)
            _log(f"kv: prefill {r['system']} ctx {ctx} ({r['prefill_layers']} layers): {r['prefill_tok_s']:.1f} tok/s "
                 f"[{r['prefill_tok_s_min']:.1f}-{r['prefill_tok_s_max']:.1f}], peak {r['peak_memory_bytes'] / 2**20:.0f} MiB")
    if budgets:
        rows.extend(capacity_rows(model, systems, budgets, probe))
    quality = []
    if prompts > 0 or document:
        quality = kv_quality.run(model, tokenizer, systems, _factory, prompts, tokens, stress_page, document, chat,
                                  kv_config=kv_config, document_text=document_text, document_tokens=document_tokens)
    default = next((n for n in systems if n.startswith("justfit") and kv_config(n) == KVConfig()), None)
    return {
        "bench": "kv", "model": getattr(model, "justfit_path", model_spec), "backend": backend(),
        "versions": {"justfit": justfit.__version__, "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__},
        "default_system": default, "default_kv": vars(KVConfig()), "rounds": rounds,
        "load_average": {"start": load_start, "end": _load()},
        "notes": {
            "timing": f"median of {rounds} interleaved rounds (order rotates each round), _min/_max across rounds, warm-up excluded",
            "decode": "kind=decode: full model, caches filled once per context with the same synthetic random K/V; "
                      "each round times `decode_steps` greedy steps then trims back to `context`",
            "prefill": f"kind=prefill: real chunked prefill ({CHUNK}-token chunks) of random tokens, fresh caches each round; "
                       f"prefill_layers = full model up to {full_prefill_max} tokens, else the first {prefill_layers} layers",
            "capacity": "kind=capacity: binary search for the longest context whose full-model KV bytes (measured per "
                        "position between the two probes on real caches, plus their fixed part) + prefill workspace (peak over start minus KV, one "
                        "layer whose hidden states are evaluated so its attention runs: the larger probe when bounded, else "
                        "linear through both probes from the first on; below the first probe measured by a real prefill at each "
                        "step of the search, workspace_measured_in_search) fit budget_bytes; kv_only_positions: KV alone",
            "bandwidth": "decode rows: bytes_per_token = the weights as held + the row's KV bytes (each step reads "
                         "both); bandwidth_pct = decode tok/s x bytes_per_token over a 256 MiB streaming read "
                         "measured in this run (bench/bandwidth.py)",
            "mlx-lm-16bit": "capacity rows derived from mlx-lm-fp16's when the model computes in float32 (a CPU): "
                            "its KV bytes per position halved, as mlx-lm's KVCache holds them for a 16-bit model "
                            "(a Mac); the workspace is mlx-lm-fp16's",
            "quality": "see kv_quality.py: teacher-forced replay of fp16 greedy trajectories through each cache",
            "mlx-lm-fp16": "mlx-lm KVCache in the model's compute dtype (float32 on CPU)",
            "layout": "mlx-lm rows run the weights in mlx-lm's layout (W [out, in]), justfit rows in JustFit's "
                      "(row-major on the CPU, models/layout.py); rows differ in the cache and the layout",
        },
        "rows": rows,
        "quality": quality,
    }


def _read_document(path: Path) -> str:
    """The text of --document-file, or a one-line UserError (missing, unreadable, not UTF-8, empty)."""
    from justfit.errors import UserError

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read --document-file {path}: {e}") from None
    if not text.strip():
        raise UserError(f"--document-file {path} is empty")
    return text


def _ints(text: str, what: str):
    from justfit.errors import UserError

    try:
        values = [int(float(c)) for c in text.split(",") if c.strip()]
    except ValueError:
        raise UserError(f"{what} must be comma-separated numbers, not {text!r}") from None
    if any(v <= 0 for v in values):
        raise UserError(f"{what} must be positive")
    return values


def kv(
    contexts: str = typer.Option("128,512,2048,8192,16384", "--contexts", help="Comma-separated context lengths."),
    rounds: int = typer.Option(5, "--rounds", help="Interleaved rounds per timing (median, min, max)."),
    steps: int = typer.Option(6, "--steps", help="Timed decode steps per system per round."),
    full_prefill_max: int = typer.Option(2048, "--full-prefill-max", help="Prefill rows on the full model up to this context."),
    prefill_layers: int = typer.Option(2, "--prefill-layers", help="Layers of the cut model for longer prefill rows."),
    budgets: str = typer.Option("256M,1G", "--budgets", help="Capacity budgets for KV + workspace (bytes, or with M/G); '' skips."),
    prompts: int = typer.Option(6, "--prompts", help="Held-out chat prompts for quality rows (0 skips them)."),
    tokens: int = typer.Option(48, "--tokens", help="Greedy trajectory length per prompt."),
    stress_page: int = typer.Option(32, "--stress-page", help="Extra quality rows at this page size (0: none)."),
    document: bool = typer.Option(True, "--document/--no-document", help="Quality rows on the long held-out document."),
    document_file: Optional[Path] = typer.Option(None, "--document-file", help="A UTF-8 text file to use as the document instead of the built-in one (first --document-tokens tokens)."),
    document_tokens: int = typer.Option(2048, "--document-tokens", help="Tokens of the document scored up to (a longer text is cut; the built-in one has 2,010)."),
    chat: bool = typer.Option(True, "--chat/--no-chat", help="Quality rows on the short chats with the default layout."),
    systems: str = typer.Option(",".join(DEFAULT_SYSTEMS), "--systems", help=f"Comma-separated, among {', '.join(SYSTEM_NAMES)}."),
    capacity_probe: str = typer.Option("4096,8192", "--capacity-probe", help="Two contexts where capacity measures the workspace."),
    model: str = typer.Option("default", "--model", help="Model spec, as for justfit chat."),
    quick: bool = typer.Option(False, "--quick", help="CI smoke: contexts 128,512, 2 rounds, 2 steps, one budget, 2 prompts, no document."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
):
    """Paged KV (default config, fp16 pages, variants) vs mlx-lm KV caches: decode, prefill, peak, capacity, quality."""
    from justfit.errors import UserError

    if quick:
        contexts, rounds, steps, budgets, prompts, tokens, document = "128,512", 2, 2, "256M", 2, 16, False
        capacity_probe = "2048,4096"
    ctxs = _ints(contexts, "--contexts")  # empty: no timing rows (quality and capacity only)
    budget_list = _ints(budgets.upper().replace("G", "e9").replace("M", "e6"), "--budgets") if budgets.strip() else []
    budget_list = [_binary_units(b) for b in budget_list]
    probe = _ints(capacity_probe, "--capacity-probe")
    if len(probe) != 2 or probe[0] >= probe[1]:
        raise UserError("--capacity-probe must be two increasing contexts")
    names = [s.strip() for s in systems.split(",") if s.strip()]
    unknown = [n for n in names if n not in SYSTEM_NAMES]
    if unknown or not names or rounds < 1 or steps < 1:
        raise UserError(f"--systems must be among {', '.join(SYSTEM_NAMES)}; --rounds and --steps at least 1")
    text = _read_document(document_file) if document_file is not None else None
    result = run(model, ctxs, steps, rounds, full_prefill_max, prefill_layers, prompts, tokens, stress_page or None,
                 names, budget_list, document, tuple(probe), chat, text, document_tokens)
    if text is not None:
        result["document_file"] = str(document_file)
    if json_out:
        print(json.dumps(result))
        return
    print(f"default_system: {result['default_system']}  load {result['load_average']}")
    for r in result["rows"]:
        if r["kind"] == "decode":
            print(f"decode   {r['system']:20s} ctx {r['context']:6d}  {r['decode_tok_s']:7.2f} tok/s "
                  f"[{r['decode_tok_s_min']:.2f}-{r['decode_tok_s_max']:.2f}]  kv {r['kv_bytes'] / 2**20:8.1f} MiB  "
                  f"{r['bandwidth_pct']:5.1f}% of bandwidth")
        elif r["kind"] == "prefill":
            print(f"prefill  {r['system']:20s} ctx {r['context']:6d}  {r['prefill_tok_s']:7.1f} tok/s "
                  f"[{r['prefill_tok_s_min']:.1f}-{r['prefill_tok_s_max']:.1f}]  peak {r['peak_memory_bytes'] / 2**20:7.0f} MiB"
                  f"  ({r['prefill_layers']} layers)")
        else:
            print(f"capacity {r['system']:20s} budget {r['budget_bytes'] / 2**20:6.0f} MiB  {r['capacity_positions']:8d} positions")
    for q in result["quality"]:
        print(f"quality  {q['system']:20s} {q['workload']:9s} page {q.get('page_size', '-')!s:4s} top1 {q['top1']:.3f}  "
              f"kl {q['kl']:.4f}  ppl {q['ppl']:.3f} (fp16 {q['ppl_fp16']:.3f})  quantized {q.get('quantized_token_fraction', 0):.2f}")


def _binary_units(b: int) -> int:
    """'256M' / '1G' were parsed as 256e6 / 1e9: read them as MiB / GiB."""
    if b % 1_000_000_000 == 0:
        return b // 1_000_000_000 << 30
    if b % 1_000_000 == 0:
        return b // 1_000_000 << 20
    return b
