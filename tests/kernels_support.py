"""Shared by the KVExec-on-kernels tests: a tiny llama and its logits through a chosen kernel backend."""

import mlx.core as mx
from mlx_lm.models import llama

from justfit.kvexec import make_cache


def tiny_llama(head_dim=64):
    """A 2-layer random llama (4 query heads, 2 KV heads), the same weights every call."""
    mx.random.seed(3)
    return llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
        head_dim=head_dim, tie_word_embeddings=True))


def kernel_logits(model, kv, monkeypatch, env, prompt, steps):
    """Logits of the prompt and of every step (token lists), under JUSTFIT_KERNELS=env; and the caches."""
    monkeypatch.setenv("JUSTFIT_KERNELS", env)
    caches = make_cache(model, kv)
    out = [model(mx.array([prompt]), cache=caches)[0]]
    for step in steps:
        out.append(model(mx.array([step]), cache=caches)[0])
    return mx.concatenate(out), caches
