"""Model loading: mlx-lm folders, HF repo ids, GGUF import and the embedded default model."""

from .load import backend, load, weight_policy
from .registry import default_model, gguf_cache_name, import_gguf, list_models, resolve, scan_models_dir
from .vocab import check_token_ids, vocab_size

__all__ = ["load", "backend", "weight_policy", "resolve", "import_gguf", "default_model", "list_models", "scan_models_dir", "gguf_cache_name",
           "check_token_ids", "vocab_size"]
