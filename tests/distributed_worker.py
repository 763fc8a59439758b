"""One rank of a distributed test run (started by mlx.launch, or alone as the 1-process reference).

  distributed_worker.py raw KV_HEADS N KINDS           tiny random llama + justfit.make_cache, greedy
  distributed_worker.py runtime MODEL HOME BITS N PROMPT   justfit.Runtime(...).generate
  distributed_worker.py session MODEL HOME BITS N PROMPT NAME   a distributed session turn + checkpoint
  distributed_worker.py follow MODEL HOME BITS N PROMPT     rank 0 leads a turn and a batch (serving.py), the others follow
  distributed_worker.py toolphase MODEL HOME BITS N PROMPT BUDGET   a turn, a tool phase, a turn (memory budget)
Rank 0 prints one JSON line: tokens, and every rank's sharding and KV bytes.
"""

import json
import sys


def tiny_llama(kv_heads: int, layers: int = 4):
    """Random-weight llama, identical on every rank (seeded): 4 query heads, `kv_heads` KV heads."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.models import llama

    mx.random.seed(0)
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=layers, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=kv_heads, rms_norm_eps=1e-5,
                           vocab_size=128, head_dim=16, tie_word_embeddings=True)
    model = llama.Model(args)
    # std 0.2 matrices: mlx-lm's default init makes a tiny model repeat one token, a test that cannot fail
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.2 if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    return model


def raw(kv_heads: str, n: str, kinds: str):
    """Greedy tokens of the tiny llama with KVExec caches (chunked prefill of a 70-token prompt) for each
    sharding kind in `kinds` (comma list) and KV bits 16 and 4: {"tensor/16": [...], ...}."""
    import mlx.core as mx

    import justfit
    from justfit.distributed import shard_model

    out, shardings, kv_bytes = {}, {}, {}
    for kind in kinds.split(","):
        for bits in (16, 4):
            model = tiny_llama(int(kv_heads))
            sharding = shard_model(model, kind=kind)
            caches = justfit.make_cache(model, justfit.KVConfig(bits=bits, page_size=32, quantized_kv_start=0))
            prompt = [(7 * i + 3) % 128 for i in range(70 if bits == 16 else 20)]  # 4-bit: a short prompt
            x = mx.array(prompt)[None]
            for i in range(0, len(prompt), 13):
                logits = model(x[:, i:i + 13], cache=caches)
                mx.eval([c.state for c in caches])  # the way mlx-lm evaluates a prefill chunk
            tokens = []
            for _ in range(int(n)):  # every rank computes the same logits, so each follows the same tokens
                t = int(mx.argmax(logits[0, -1]))
                tokens.append(t)
                logits = model(mx.array([[t]]), cache=caches)
            key = f"{kind}/{bits}"
            out[key], shardings[key], kv_bytes[key] = tokens, sharding.as_dict(), sum(c.nbytes for c in caches)
    return shardings, kv_bytes, out, {}


def runtime(folder, home, bits, n, prompt, session=None):
    import justfit
    from justfit.distributed import world

    # drafter "none": the prompt-lookup gate decides from wall-clock timings, which differ per rank
    rt = justfit.Runtime(model=folder, kv=justfit.KVConfig(bits=int(bits), page_size=32, quantized_kv_start=0),
                         home=home, drafter="none")
    extra = {}
    if session == "-follow":  # rank 0 leads a turn and a batch of two, the follower mirrors (the server's way)
        from justfit.distributed.serving import Leader, follow_turns

        if not world().is_front:
            follow_turns(rt)
            return rt.sharding, rt.index.pool.nbytes, [], {}
        leader = Leader(rt)
        outs = [leader.generate(prompt, max_tokens=int(n)).tokens]
        outs += [g.tokens for g in leader.generate_batch([prompt + " again", prompt], max_tokens=int(n))]
        leader.stop()
        return rt.sharding, rt.index.pool.nbytes, outs, {}
    if session:
        from justfit.distributed.sessions import open_session

        s = open_session(rt, session)
        g = s.generate(prompt, max_tokens=int(n))
        s.checkpoint()
        extra = {"reused_tokens": g.stats.reused_tokens, "history": len(s.tokens)}
    else:
        g = rt.generate(prompt, max_tokens=int(n))
    return rt.sharding, rt.index.pool.nbytes, g.tokens, extra


def toolphase(folder, home, bits, n, prompt, budget):
    """PhaseSwap per rank: each rank's budget, a tool phase that releases this rank's weights, then turns."""
    import justfit

    rt = justfit.Runtime(model=folder, kv=justfit.KVConfig(bits=int(bits), page_size=32, quantized_kv_start=0),
                         home=home, drafter="none", memory_budget=budget)
    before = rt.generate(prompt, max_tokens=int(n)).tokens
    with rt.tool_phase() as released:
        weights = {c["kind"]: 0 for c in rt.residency()["components"]}
        for c in rt.residency()["components"]:
            weights[c["kind"]] += c["bytes"] if c["resident"] else 0
    after = rt.generate(prompt, max_tokens=int(n)).tokens
    later = rt.generate(prompt + " and then", max_tokens=int(n)).tokens
    extra = {"released": released, "resident_in_tool_phase": weights, "budget": rt.residency()["budget_bytes"]}
    return rt.sharding, rt.index.pool.nbytes, [before, after, later], extra


def main(argv):
    from justfit.distributed import gather_strings, world

    mode, rest = argv[0], argv[1:]
    if mode == "raw":
        sharding, kv_bytes, tokens, extra = raw(*rest)
    elif mode == "toolphase":
        sharding, kv_bytes, tokens, extra = toolphase(*rest)
    else:
        sharding, kv_bytes, tokens, extra = runtime(*rest[:5], session={"session": rest[5:6] and rest[5], "follow": "-follow"}.get(mode))
    sharding = sharding if isinstance(sharding, dict) else sharding.as_dict()
    mine = json.dumps({"rank": world().rank, "sharding": sharding, "kv_bytes": kv_bytes, "tokens": tokens,
                       **({"released": extra["released"]} if "released" in extra else {})})
    ranks = [json.loads(r) for r in gather_strings(mine)]
    if world().is_front:
        print(json.dumps({"tokens": tokens, "ranks": ranks, **extra}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
