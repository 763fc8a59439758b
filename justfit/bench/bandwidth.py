"""The memory-bandwidth yardstick of the decode benches: bytes a generated token reads, over a streaming-read
bandwidth measured in the same run.

Decode of a small batch reads every weight once per token plus the KV cache of its context, so
(bytes per token x tokens per second) / (streaming read bandwidth) is the share of the hardware limit a
system reaches. The bandwidth is measured here (a sum over an array well past the caches, best of a few
runs) rather than taken from a datasheet: the bench's machine, at that moment, is the reference.
"""

import time

STREAM_BYTES = 256 << 20


def stream_read_bandwidth(reps: int = 5) -> float:
    """Bytes per second a 256 MiB float32 array is read at: the faster of a sum (one thread) and a one-row
    product with it (BLAS, every thread), best of `reps` each."""
    import mlx.core as mx

    a = mx.ones((8192, STREAM_BYTES // 4 // 8192), dtype=mx.float32)
    x = mx.ones((1, 8192), dtype=mx.float32)
    mx.eval(a, x)
    best = float("inf")
    for op, args in ((mx.sum, (a,)), (mx.matmul, (x, a))):
        for _ in range(reps):
            t = time.perf_counter()
            mx.eval(op(*args))
            best = min(best, time.perf_counter() - t)
    return STREAM_BYTES / best


def compute_dtype(model):
    """The dtype the model computes in, and mlx-lm's KVCache stores K/V in: its embedding's output dtype
    (float32 on a CPU, whatever the weights are stored in)."""
    import mlx.core as mx

    try:
        return model.model.embed_tokens(mx.array([[0]])).dtype
    except (AttributeError, TypeError, ValueError):
        return mx.float32


def weight_bytes(model) -> int:
    """Bytes of the model's parameters as held (quantized words, scales and biases included)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def kv_bytes_per_token(model, bytes_per_element: float) -> float:
    """KV bytes a cached token takes over all layers: 2 (keys, values) x KV heads x head dim per layer."""
    args = getattr(model, "args", None)
    layers = len(model.layers)
    heads = getattr(args, "num_key_value_heads", None) or getattr(args, "num_attention_heads", 1)
    dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    return 2.0 * layers * heads * dim * bytes_per_element


def columns(weights: int, kv_per_token: float, context: float, tok_s: float, bandwidth: float) -> dict:
    """The row's bandwidth fields: bytes read per generated token at `context` tokens and its share of the limit."""
    per_token = weights + kv_per_token * context
    return {"bytes_per_token": int(per_token), "stream_bandwidth_bytes_s": int(bandwidth),
            "bandwidth_limit_tok_s": round(bandwidth / per_token, 1),
            "bandwidth_pct": round(100.0 * tok_s * per_token / bandwidth, 1)}
