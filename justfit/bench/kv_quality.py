"""Quality rows of `justfit bench kv`: each system's KV cache against mlx-lm's float KVCache.

Workloads (`workload` field): `chat` (short held-out prompts, default page layout: usually nothing seals),
`stress` (the same chats with small pages and no full-precision start: the quantized format itself) and
`document` (kv_document.py, ~2.4k tokens written for this bench, teacher-forced in 64-token chunks with the
default layout; metrics over positions >= DOC_SCORED_FROM, all of which attend to sealed quantized pages).
`quantized_token_fraction`: share of cached tokens stored quantized; `quantized_read_fraction`: share of the
keys the scored queries read from quantized pages (the float window reads the recent ones in float).

For each held-out chat prompt, a greedy trajectory is generated with mlx-lm's float KVCache (whose
per-step logits are the reference); every other system then replays prompt + trajectory token by token
through its own cache (teacher forcing on the decode path). Free-running agreement needs no extra pass:
a greedy run with the system's cache is identical to the replay until the first step whose argmax
differs, so agreement = (first differing step) / steps.
"""

import sys

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a ten-year-old.",
    "List three uses of Python in science.",
    "How do airplanes stay in the air?",
    "Give me a simple recipe for pancakes.",
    "What causes the seasons on Earth?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Write a short email asking my manager for a day off.",
    "What is the difference between a list and a tuple in Python?",
    "Suggest three names for a coffee shop.",
    "Why is the sky blue?",
    "Translate 'good morning, how are you?' into Spanish.",
    "Write a limerick about a cat who loves boxes.",
    "What are the health benefits of walking every day?",
    "Explain what a black hole is.",
    "How do I reverse a string in JavaScript?",
    "Give two tips for learning a new language.",
    "What is photosynthesis?",
    "Describe a sunset over the mountains in one paragraph.",
    "What does HTTP stand for and what is it used for?",
    "Tell me a fun fact about octopuses.",
    "How can I make my code easier to read?",
    "What is the boiling point of water at sea level?",
]


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


def _step_logits(model, caches, ids, trajectory):
    """Float32 logits [steps, vocab]: after the prompt, then after each trajectory token but the last."""
    import mlx.core as mx

    logits = model(mx.array(ids)[None], cache=caches)[0, -1]
    out = [logits]
    for t in trajectory[:-1]:
        logits = model(mx.array([[t]]), cache=caches)[0, -1]
        mx.eval(logits)
        out.append(logits)
    return mx.stack(out).astype(mx.float32)


def reference(model, tokenizer, n_prompts: int, n_tokens: int):
    """[(prompt ids, greedy trajectory, fp16 step logits)] with mlx-lm's KVCache."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    refs = []
    for i, text in enumerate(PROMPTS[:n_prompts]):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        caches, traj, steps = make_prompt_cache(model), [], []
        logits = model(mx.array(ids)[None], cache=caches)[0, -1]
        for _ in range(n_tokens):  # no stop at EOS: every prompt yields n_tokens steps
            steps.append(logits)
            traj.append(int(mx.argmax(logits)))
            logits = model(mx.array([[traj[-1]]]), cache=caches)[0, -1]
        refs.append((ids, traj, mx.stack(steps).astype(mx.float32)))
        _log(f"quality: reference {i + 1}/{n_prompts} ({len(ids)} prompt tokens)")
    return refs


def metrics(ref_logits, logits, trajectory):
    """top1, kl, nll sums and first divergence of one replay against the fp16 reference."""
    import mlx.core as mx
    import numpy as np

    lp0 = ref_logits - mx.logsumexp(ref_logits, axis=-1, keepdims=True)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    traj = mx.array(trajectory)
    rows = mx.arange(len(trajectory))
    same = np.array(mx.argmax(logits, axis=-1) == traj)
    return {
        "top1": float(same.mean()),
        "kl": float((mx.exp(lp0) * (lp0 - lp)).sum(axis=-1).mean()),
        "nll": -np.array(lp[rows, traj]),
        "nll_fp16": -np.array(lp0[rows, traj]),
        "agreement": float(np.argmin(same) if not same.all() else len(same)) / len(same),
    }


def quality_rows(model, refs, systems):
    """One row per (system, (page_size, quantized_kv_start) or None): mean top1, kl, agreement; ppl and ppl_fp16 over all steps."""
    import numpy as np

    rows = []
    for name, layout, make in systems:
        page_size, sinks = layout or (None, None)
        per = []
        quantized, reads = [], []
        for ids, traj, ref_logits in refs:
            if make is None:  # the reference system itself: its replay is the generation pass
                per.append(metrics(ref_logits, ref_logits, traj))
                continue
            caches = make()
            per.append(metrics(ref_logits, _step_logits(model, caches, ids, traj), traj))
            quantized.append(_quantized_fraction(caches))
            reads.append(_quantized_reads(caches, range(len(ids) - 1, len(ids) + len(traj) - 1)))
        nll, nll0 = np.concatenate([p["nll"] for p in per]), np.concatenate([p["nll_fp16"] for p in per])
        row = {"system": name, "top1": float(np.mean([p["top1"] for p in per])),
               "kl": float(np.mean([p["kl"] for p in per])), "ppl": float(np.exp(nll.mean())),
               "ppl_fp16": float(np.exp(nll0.mean())), "agreement": float(np.mean([p["agreement"] for p in per])),
               "prompts": len(refs), "tokens": len(refs[0][1])}
        if page_size is not None:
            row["page_size"], row["quantized_kv_start"] = page_size, sinks
            row["quantized_token_fraction"] = float(np.mean(quantized))
            row["quantized_read_fraction"] = float(np.mean(reads))
        rows.append(row)
        _log(f"quality: {name} page {page_size}: top1 {row['top1']:.3f} kl {row['kl']:.4f} "
             f"ppl {row['ppl']:.3f} (fp16 {row['ppl_fp16']:.3f}) agreement {row['agreement']:.3f}")
    return rows


def _quantized_reads(caches, positions):
    """Share of the keys the queries at `positions` read from quantized pages (1.0 for mlx-lm's
    QuantizedKVCache): older than the float window and past quantized_kv_start. Counted for one query at
    a time; a chunk's queries may read more pages in float, so with chunks this is an upper bound."""
    from justfit.kvexec import PagedKVCache

    paged = [c for c in caches if isinstance(c, PagedKVCache)]
    if not paged:
        return 1.0 if hasattr(caches[0], "bits") else 0.0
    kv = paged[0].kv
    if kv.bits == 16:
        return 0.0
    P = kv.page_size
    start = -(-kv.quantized_kv_start // P) * P
    quant = sum(max(0, min(t + 1, (t // P - kv.float_pages) * P) - start) for t in positions)
    return quant / sum(t + 1 for t in positions)


def _quantized_fraction(caches):
    """Share of cached tokens stored in quantized pages (1.0 for mlx-lm's QuantizedKVCache)."""
    from justfit.kvexec import PagedKVCache

    paged = [c for c in caches if isinstance(c, PagedKVCache)]
    if not paged:
        return 1.0 if hasattr(caches[0], "bits") else 0.0
    c = paged[0]
    return sum(n for _, n, p in c.pages() if p.kind == "q") / max(1, c.offset)


DOC_CHUNK = 64  # teacher-forcing chunk for the document (like agent turns: prefill of a few dozen tokens)
DOC_SCORED_FROM = 768  # first scored position: past the full-precision first page, the float window's page and
# one sealed 4-bit page (default layout), so every scored position reads 4-bit pages


DOC_MAX_TOKENS = 2048  # by default a longer --document-file is cut here (the built-in document has 2,010 tokens)


def document_ids(tokenizer, text=None, max_tokens: int = DOC_MAX_TOKENS):
    """Token ids of the built-in document, or of `text` (a user's own file), at most max_tokens."""
    from .kv_document import DOCUMENT

    return list(tokenizer.encode(DOCUMENT if text is None else text))[:max_tokens]


def _chunked_logits(model, caches, ids):
    """Float32 logits [len(ids), vocab] of the document fed in DOC_CHUNK-token chunks."""
    import mlx.core as mx

    out = []
    for i in range(0, len(ids), DOC_CHUNK):
        logits = model(mx.array(ids[i : i + DOC_CHUNK])[None], cache=caches)[0].astype(mx.float32)
        mx.eval(logits)
        out.append(logits)
    return mx.concatenate(out)


def document_rows(model, ids, systems):
    """One row per system: top1 (argmax agreement with fp16), kl, ppl of the document's next tokens."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    ref = _chunked_logits(model, make_prompt_cache(model), ids)[DOC_SCORED_FROM - 1 : -1]
    target = ids[DOC_SCORED_FROM:]
    rows = []
    for name, layout, make in systems:
        if make is None:
            continue
        caches = make()
        logits = _chunked_logits(model, caches, ids)[DOC_SCORED_FROM - 1 : -1]
        m = metrics(ref, logits, mx.argmax(ref, axis=-1).tolist())
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        lp0 = ref - mx.logsumexp(ref, axis=-1, keepdims=True)
        rows_ = mx.arange(len(target))
        nll = -np.array(lp[rows_, mx.array(target)])
        nll0 = -np.array(lp0[rows_, mx.array(target)])
        row = {"system": name, "workload": "document", "tokens": len(ids), "scored_from": DOC_SCORED_FROM,
               "top1": m["top1"], "kl": m["kl"], "ppl": float(np.exp(nll.mean())), "ppl_fp16": float(np.exp(nll0.mean())),
               "quantized_token_fraction": _quantized_fraction(caches),
               "quantized_read_fraction": _quantized_reads(caches, range(DOC_SCORED_FROM - 1, len(ids) - 1))}
        row["ppl_delta"] = row["ppl"] / row["ppl_fp16"] - 1
        if layout is not None:
            row["page_size"], row["quantized_kv_start"] = layout
        rows.append(row)
        _log(f"quality: document {name}: top1 {row['top1']:.3f} kl {row['kl']:.4f} ppl {row['ppl']:.3f} "
             f"(fp16 {row['ppl_fp16']:.3f}) quantized {row['quantized_token_fraction']:.2f} "
             f"read {row['quantized_read_fraction']:.2f}")
    return rows


def run(model, tokenizer, systems, factory, prompts, tokens, stress_page, document, chat=True, kv_config=None,
        document_text=None, document_tokens=DOC_MAX_TOKENS):
    """All quality rows of `justfit bench kv` for `systems` (names), with `factory(name, model, page, start)`;
    `kv_config(name, page, start)` gives a justfit system's KVConfig (passed in: bench kv owns the names);
    `document_text` replaces the built-in document, cut at `document_tokens`."""
    def layout(name, page=None, start=None):
        if name.startswith("mlx-lm"):
            return None
        kv = kv_config(name, page, start)
        return (kv.page_size, kv.quantized_kv_start)

    plain = [(n, layout(n), None if n == "mlx-lm-fp16" else factory(n, model)) for n in systems]
    rows = []
    if prompts > 0:
        refs = reference(model, tokenizer, prompts, tokens)
        if chat:
            rows += [dict(r, workload="chat") for r in quality_rows(model, refs, plain)]
        if stress_page:
            stress = [(n, layout(n, stress_page, 0), factory(n, model, stress_page, 0)) for n in systems
                      if n.startswith("justfit") and n != "justfit-fp16"]
            stress += [(n, layout(n, stress_page, stress_page), factory(n, model, stress_page, stress_page))
                       for n in systems if n == "justfit-default"]  # the same with one page of full-precision sinks
            stress += [p for p in plain if p[0].startswith("mlx-lm") and p[2] is not None]
            rows += [dict(r, workload="stress") for r in quality_rows(model, refs, stress)]
    if document:
        ids = document_ids(tokenizer, document_text, document_tokens)
        if len(ids) < DOC_SCORED_FROM + 64:
            from justfit.errors import UserError

            raise UserError(f"the document has {len(ids)} tokens; quality rows score positions from "
                            f"{DOC_SCORED_FROM}, so give a text of at least {DOC_SCORED_FROM + 64} tokens")
        rows += document_rows(model, ids, plain)
    return rows
