"""Tiny random configs for every model family the installed mlx-lm ships, and a greedy run over them (used by
test_kvexec_families.py and test_layout.py)."""

import dataclasses
import importlib
import pkgutil
import typing

import mlx_lm.models

NOT_MODELS = {"activations", "base", "bitlinear_layers", "cache", "gated_delta", "mla", "pipeline", "rope_utils",
              "ssm", "switch_layers"}
TINY = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, head_dim=16, max_position_embeddings=512, n_routed_experts=4, num_experts=4,
            num_experts_per_tok=2, n_shared_experts=1, num_shared_experts=1, moe_intermediate_size=32,
            num_local_experts=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=16, n_group=1, topk_group=1, first_k_dense_replace=1, sliding_window=8, rope_theta=10000.0,
            rms_norm_eps=1e-5, layer_norm_eps=1e-5, norm_eps=1e-5, layer_norm_epsilon=1e-5, d_model=64, n_layers=2,
            n_heads=4, n_kv_heads=2, num_layers=2, num_heads=4, num_kv_heads=2, hidden_dim=96, dim=64, ffn_dim=96,
            n_embd=64, n_head=4, n_layer=2, n_positions=512, n_ctx=512, embed_dim=64, model_dim=64, max_seq_len=512,
            seq_length=512, routed_scaling_factor=1.0, moe_num_experts=4, tie_word_embeddings=True,
            rope_scaling=None, sliding_window_pattern=2, partial_rotary_factor=1.0)

SPECIAL = {  # families that need inputs or a backend this test does not provide
    "bitnet": "needs a Metal kernel (no Metal backend on CPU)",
    "olmo": "needs the ai2-olmo package",
    "prism_hadamard_qwen35": "needs a Hadamard-packed checkpoint, not a random config",
    "phi3small": "MLX crashes (SIGSEGV in RoPE) on the generic tiny config: block-sparse attention needs its own",
}
PROMPT = [(5 * i + 3) % 120 + 1 for i in range(40)]  # > 2 pages of 16 tokens, and past the sliding window (8)


def greedy(model, caches, n=6, chunk=17) -> list:
    """n greedy tokens after PROMPT, prefilled in chunks that cross page boundaries mid-chunk."""
    import mlx.core as mx

    x = mx.array(PROMPT)[None]
    for i in range(0, len(PROMPT), chunk):
        logits = model(x[:, i : i + chunk], cache=caches)
    out = []
    for _ in range(n):
        out.append(int(mx.argmax(logits[0, -1])))
        logits = model(mx.array([[out[-1]]]), cache=caches)
    return out


def families():
    """Names of the mlx_lm.models modules that may define a model."""
    return sorted(m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__) if m.name not in NOT_MODELS)


def _guess(name: str, tp):
    """A small value for a required field nobody listed in TINY, from its name and annotation."""
    t = str(tp).lower()
    if "bool" in t:
        return False
    if name == "layer_types":
        return ["full_attention"] * TINY["num_hidden_layers"]
    if "list" in t or "tuple" in t:
        return []
    if "dict" in t:
        return {}
    if "float" in t:
        return 1e-5 if "eps" in name else 1.0
    if "int" in t:
        if "layers" in name or "heads" in name or "experts" in name:
            return 2
        return 16 if ("size" in name or "dim" in name) else 1
    if "str" in t:
        return ""
    return None


def tiny_args(module_name: str) -> dict:
    """A config dict small enough to build and run the family in well under a second."""
    mod = importlib.import_module(f"mlx_lm.models.{module_name}")
    out = {"model_type": module_name}
    hints = typing.get_type_hints(mod.ModelArgs) if hasattr(mod, "ModelArgs") else {}
    for f in dataclasses.fields(mod.ModelArgs):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if f.name in TINY:
            out[f.name] = TINY[f.name]
        elif f.name in ("text_config", "language_config", "llm_config"):
            out[f.name] = {**TINY, "model_type": module_name}
        elif required:
            out[f.name] = _guess(f.name, hints.get(f.name, f.type))
    return out


def build(module_name: str):
    """(model, None) or (None, reason) for one family."""
    mod = importlib.import_module(f"mlx_lm.models.{module_name}")
    if not hasattr(mod, "ModelArgs") or not hasattr(mod, "Model"):
        return None, "defines no ModelArgs/Model"
    args = mod.ModelArgs.from_dict(tiny_args(module_name))
    return mod.Model(args), None
