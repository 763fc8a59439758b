"""Shared helpers for the agent tests: the import path and a tiny random-weight runtime that uses
the real SmolLM2 tokenizer (so grammars and templates are the real ones, but steps take ms)."""

import sys
from pathlib import Path

AGENTS = Path(__file__).resolve().parents[1] / "agents"
if str(AGENTS) not in sys.path:
    sys.path.insert(0, str(AGENTS))


class TinyRuntime:
    """What Agent needs from a Runtime: model, tokenizer, make_cache(), home."""

    def __init__(self, model_dir, home, seed: int = 0):
        import mlx.core as mx
        from mlx_lm.models import llama
        from mlx_lm.utils import load_tokenizer

        mx.random.seed(seed)
        args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                               vocab_size=49152, head_dim=16, tie_word_embeddings=True)
        self.model = llama.Model(args)
        mx.eval(self.model.parameters())
        self.model.justfit_path = f"tiny-random-{seed}"
        self.tokenizer = load_tokenizer(Path(model_dir))
        self.home = Path(home)
        self.phases = 0

    def make_cache(self):
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model)

    def tool_phase(self):
        """Counts tool phases so tests can see each tool ran inside one."""
        import contextlib

        self.phases += 1
        return contextlib.nullcontext()
