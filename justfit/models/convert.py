"""Convert a Llama-family GGUF file into an mlx-lm model folder (weights, config, tokenizer)."""

import json
import os
import shutil
import sys
from pathlib import Path

from ..errors import UserError
from ..progress import bar
from .gguf_reader import check_supported
from .tokenizer import write_tokenizer

# GGUF tensor names -> mlx-lm Llama module names (per block and global).
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _scalar(v):
    """GGUF metadata values arrive as mx arrays; make them plain Python numbers."""
    return v.item() if hasattr(v, "item") else v


def _rename(name: str) -> str:
    module, _, leaf = name.rpartition(".")
    if module.startswith("blk."):
        _, idx, part = module.split(".", 2)
        if part not in _BLOCK_NAMES:
            raise UserError(f"unexpected tensor {name!r} in GGUF (not a Llama-family layer)")
        return f"model.layers.{idx}.{_BLOCK_NAMES[part]}.{leaf}"
    if module not in _GLOBAL_NAMES:
        raise UserError(f"unexpected tensor {name!r} in GGUF (not a Llama-family model)")
    return f"{_GLOBAL_NAMES[module]}.{leaf}"


def _unpermute(x, n_head: int):
    """Undo llama.cpp's rope row permutation of q/k (same on weights, scales and biases)."""
    rows = x.shape[0]
    return x.reshape(n_head, rows // n_head // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def build_config(meta: dict, weights: dict) -> dict:
    """mlx-lm config.json for the GGUF's architecture and quantization (weights already renamed)."""
    arch = meta["general.architecture"]
    get = lambda key, default=None: _scalar(meta.get(f"{arch}.{key}", default))  # noqa: E731
    n_head = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = get("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(get("attention.head_count_kv", n_head)),
        "head_dim": int(get("attention.key_length", hidden // n_head)),
        "rms_norm_eps": float(f'{get("attention.layer_norm_rms_epsilon", 1e-5):.6g}'),  # stored as float32
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "lm_head.weight" not in weights,
    }
    if "tokenizer.ggml.bos_token_id" in meta:
        config["bos_token_id"] = int(_scalar(meta["tokenizer.ggml.bos_token_id"]))
    if "tokenizer.ggml.eos_token_id" in meta:
        config["eos_token_id"] = int(_scalar(meta["tokenizer.ggml.eos_token_id"]))
    quant = _quantization(weights)
    if quant:
        config["quantization"] = quant
    return config


def _quantization(weights: dict) -> dict:
    """Per-module quantization: the commonest bits as default, the others listed by module."""
    bits = {}
    for name, w in weights.items():
        if name.endswith(".scales"):
            module = name[: -len(".scales")]
            bits[module] = weights[module + ".weight"].shape[-1] // w.shape[-1]
    if not bits:
        return {}
    values = list(bits.values())
    common = max(set(values), key=values.count)
    quant = {"group_size": 32, "bits": common, "mode": "affine"}
    for module, b in bits.items():
        if b != common:
            quant[module] = {"group_size": 32, "bits": b, "mode": "affine"}
    return quant


def convert_gguf(gguf_path, out_dir, log=None) -> Path:
    """Convert `gguf_path` into the mlx-lm folder `out_dir`, atomically (temp folder, then rename)."""
    import mlx.core as mx

    log = log or (lambda msg: print(msg, file=sys.stderr))
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    check_supported(gguf_path)
    log(f"converting {gguf_path.name} into {out_dir} ...")
    try:
        raw, meta = mx.load(str(gguf_path), return_metadata=True)
    except Exception as e:  # MLX's GGUF reader: corrupt data past a valid header
        raise UserError(f"could not read GGUF {gguf_path}: {e}") from None
    weights = {}
    for name, w in raw.items():
        if w.dtype in (mx.float16, mx.bfloat16) and not name.endswith(".weight"):
            w = w.astype(mx.float32)  # scales/biases: fp16 scales are ~40x slower on CPU
        weights[_rename(name)] = w
    config = build_config(meta, weights)
    with bar(len(weights), f"converting {gguf_path.name}") as advance:
        for name in list(weights):
            if ".q_proj." in name:
                weights[name] = _unpermute(weights[name], config["num_attention_heads"])
            elif ".k_proj." in name:
                weights[name] = _unpermute(weights[name], config["num_key_value_heads"])
            mx.eval(weights[name])  # the work is lazy: do it here, tensor by tensor, so the bar moves
            advance()
    tmp = out_dir.with_name(out_dir.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        write_tokenizer(meta, tmp)
        (tmp / "justfit.json").write_text(json.dumps({"source": str(gguf_path.resolve()), "name": out_dir.name}))
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    except OSError as e:
        raise UserError(f"could not write converted model to {out_dir}: {e.strerror}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"converted {gguf_path.name}: {config['num_hidden_layers']} layers, vocab {config['vocab_size']}")
    return out_dir
