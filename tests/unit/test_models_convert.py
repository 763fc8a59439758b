"""GGUF import: tiny files of every supported tensor type round-trip to the same logits as an
independent numpy Llama forward pass over the file's dequantized (unpermuted) weights."""

import numpy as np
import pytest

from tests.gguf_writer import write_tiny_llama_gguf


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, theta):
    """Non-traditional (HF) rope over the last axis of x: [heads, T, D]."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2) / d)
    ang = np.arange(x.shape[1])[:, None] * inv[None]
    cos, sin = np.cos(ang), np.sin(ang)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], -1)


def reference_logits(cfg: dict, w: dict, ids: list) -> np.ndarray:
    """Plain numpy Llama: RMSNorm, rope, causal GQA attention, SwiGLU, tied or separate head."""
    H, KV, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    x = w["model.embed_tokens.weight"][ids].astype(np.float64)
    T = len(ids)
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(cfg["num_hidden_layers"]):
        p = lambda n, i=i: w[f"model.layers.{i}.{n}.weight"].astype(np.float64)  # noqa: E731
        h = _rms(x, p("input_layernorm"), eps)
        q = _rope((h @ p("self_attn.q_proj").T).reshape(T, H, D).transpose(1, 0, 2), theta)
        k = _rope((h @ p("self_attn.k_proj").T).reshape(T, KV, D).transpose(1, 0, 2), theta)
        v = (h @ p("self_attn.v_proj").T).reshape(T, KV, D).transpose(1, 0, 2)
        k, v = np.repeat(k, H // KV, 0), np.repeat(v, H // KV, 0)
        s = q @ k.transpose(0, 2, 1) / np.sqrt(D) + mask
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        x = x + (a @ v).transpose(1, 0, 2).reshape(T, H * D) @ p("self_attn.o_proj").T
        h = _rms(x, p("post_attention_layernorm"), eps)
        g = h @ p("mlp.gate_proj").T
        x = x + ((g / (1 + np.exp(-g))) * (h @ p("mlp.up_proj").T)) @ p("mlp.down_proj").T
    x = _rms(x, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ head.T


@pytest.mark.parametrize("tensor_type", ["F32", "F16", "Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("weights", ["quantized", "fp32"])
def test_tiny_gguf_round_trips_to_reference_logits(tmp_path, tensor_type, weights):
    import mlx.core as mx

    from justfit.models import import_gguf, load

    g = write_tiny_llama_gguf(tmp_path / f"tiny-{tensor_type}.gguf", tensor_type=tensor_type,
                              tie_embeddings=tensor_type != "Q8_0")
    folder = import_gguf(g.path, home=tmp_path / "home", log=lambda m: None)
    model, tok = load(str(folder), home=tmp_path / "home", weights=weights)
    ids = tok.encode("the quick brown fox", add_special_tokens=False)
    assert len(ids) >= 3
    got = np.array(model(mx.array([ids]))[0].astype(mx.float32))
    cfg = dict(g.config, rope_theta=g.config.get("rope_theta", 10000.0))
    want = reference_logits(cfg, g.weights, ids)
    assert np.abs(got - want).max() < 2e-3 * max(1.0, np.abs(want).max())


def test_import_is_cached_and_listed(tmp_path):
    from justfit.models import import_gguf, list_models

    g = write_tiny_llama_gguf(tmp_path / "tiny.gguf", tensor_type="Q4_0")
    home = tmp_path / "home"
    first = import_gguf(g.path, home=home, log=lambda m: None)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    again = import_gguf(g.path, home=home, log=lambda m: None)
    assert again == first and (first / "model.safetensors").stat().st_mtime_ns == stamp
    rows = list_models(home)
    assert [r["name"] for r in rows] == [first.name] and rows[0]["bytes"] > 0


def test_a_models_dir_lists_folders_by_name_and_gguf_files_by_stem(tmp_path):
    from justfit.errors import UserError
    from justfit.models import import_gguf, scan_models_dir

    g = write_tiny_llama_gguf(tmp_path / "Tiny.Q4_0.gguf", tensor_type="Q4_0")
    folder = import_gguf(g.path, home=tmp_path / "home", log=lambda m: None)
    (tmp_path / "notes.txt").write_text("not a model")
    (tmp_path / "empty").mkdir()
    rows = dict(scan_models_dir(tmp_path / "home" / "models")) | dict(scan_models_dir(tmp_path))
    assert rows == {folder.name: str(folder), "Tiny.Q4_0": str(g.path)}
    with pytest.raises(UserError, match="no such folder"):
        scan_models_dir(tmp_path / "missing")


def test_a_converted_gguf_served_by_name_is_not_listed_again_under_its_cache_folder(tmp_path):
    from types import SimpleNamespace

    from justfit.models import import_gguf
    from justfit.server.app import _cached_models

    g = write_tiny_llama_gguf(tmp_path / "tiny.gguf", tensor_type="Q4_0")
    other = write_tiny_llama_gguf(tmp_path / "other.gguf", tensor_type="Q8_0", seed=1)
    home = tmp_path / "home"
    for f in (g, other):
        import_gguf(f.path, home=home, log=lambda m: None)
    served = [SimpleNamespace(path=str(g.path), gguf=True), SimpleNamespace(path=str(tmp_path / "gone.gguf"), gguf=True),
              SimpleNamespace(path=str(tmp_path / "home" / "models"), gguf=False)]
    names = [row["name"] for row in _cached_models(served, home)]
    assert len(names) == 1 and names[0].startswith("other-"), names


def test_spm_tokenizer_gguf_loads_and_generates(tmp_path):
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    import justfit

    g = write_tiny_llama_gguf(tmp_path / "spm.gguf", tensor_type="Q8_0", tokenizer="llama")
    rt = justfit.Runtime(model=str(g.path), kv=justfit.KVConfig(bits=16), home=tmp_path / "home")
    ids = rt.encode("the quick brown fox")
    assert "quick brown fox" in rt.tokenizer.decode(ids)  # SPM vocab through the chat template
    out = rt.generate("the quick brown fox", max_tokens=4)
    ref = [t for t, _ in generate_step(mx.array(ids), rt.model, max_tokens=4)]
    assert out.tokens == ref[: len(out.tokens)]
    assert len(out.tokens) == 4 or out.stats.finish_reason == "stop"
