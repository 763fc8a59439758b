"""Shared helpers for the agent tests: the import path and a tiny random-weight runtime that uses
the real SmolLM2 tokenizer (so grammars and templates are the real ones, but steps take ms)."""

import json
import shutil
import sys
from pathlib import Path

AGENTS = Path(__file__).resolve().parents[1] / "agents"
if str(AGENTS) not in sys.path:
    sys.path.insert(0, str(AGENTS))


def tiny_model_folder(model_dir, root, seed: int = 0, context: int = 0) -> Path:
    """An mlx-lm folder: a 2-layer random llama (float32) with the default model's tokenizer files;
    context: its max_position_embeddings (for prompts past the default model's 8k, such as agent CLIs')."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    folder = Path(root) / (f"tiny-agent-{seed}" + (f"-{context}" if context else ""))
    if (folder / "config.json").exists():
        return folder
    mx.random.seed(seed)
    config = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=49152,
                  head_dim=16, tie_word_embeddings=True, rope_theta=10000.0)
    if context:
        config["max_position_embeddings"] = context
    model = llama.Model(llama.ModelArgs(**config))
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    for f in Path(model_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, folder / f.name)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def TinyRuntime(model_dir, home, seed: int = 0):
    """A real justfit.Runtime over the tiny model, counting the tool phases agents enter (rt.phases)."""
    import justfit

    class Counting(justfit.Runtime):
        phases = 0

        def tool_phase(self, session=None):
            self.phases += 1
            return super().tool_phase(session)

    folder = tiny_model_folder(model_dir, Path(home) / "models", seed)
    return Counting(model=str(folder), kv=justfit.KVConfig(bits=16), home=home)
