"""Load a model like mlx_lm.load, for any spec JustFit accepts, in the fastest safe dtype."""

import os

from ..errors import UserError
from .device import backend
from .registry import resolve

WEIGHT_POLICIES = ("auto", "fp32", "quantized")
JUNK_ERRORS = (RuntimeError, TypeError, KeyError, AttributeError, IndexError, ImportError, UnicodeError)


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def _check_chat_template(tokenizer, spec: str):
    """Render one message now, so a broken chat template is a load error (exit 2), not a crash later."""
    if not getattr(tokenizer, "chat_template", None):
        return
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    except Exception as e:  # jinja2 syntax/undefined errors and anything the template raises
        raise UserError(f"model {spec!r} has a broken chat template ({type(e).__name__}: {_first_line(e)})") from None


def weight_policy(model) -> str:
    """On the CPU: the weights as stored (4/8-bit, computed by qmm.c: qlinear.py) when the kernel runs here
    and was measured faster than float32 weights (tuning.py); else fp32 when the dequantized weights take
    at most a quarter of RAM (MLX's CPU quantized matmul is slow); else as stored. JUSTFIT_WEIGHTS overrides."""
    choice = os.environ.get("JUSTFIT_WEIGHTS", "auto")
    if choice not in WEIGHT_POLICIES:
        raise UserError(f"JUSTFIT_WEIGHTS must be one of {', '.join(WEIGHT_POLICIES)}, not {choice!r}")
    if choice != "auto":
        return choice
    if backend() != "cpu":
        return "quantized"
    from . import qmm, tuning

    if qmm.available() and tuning.choices()["quantized"]:
        return "quantized"
    import psutil

    return "fp32" if _float32_bytes(model) <= psutil.virtual_memory().total // 4 else "quantized"


def _float32_bytes(model) -> int:
    """Bytes the model's weights would take dequantized to float32."""
    from mlx.utils import tree_flatten

    n = sum(v.size for k, v in tree_flatten(model.parameters()) if not k.endswith((".scales", ".biases")))
    for _, m in model.named_modules():
        if hasattr(m, "bits") and "scales" in m:  # packed uint32 words hold 32/bits values each
            n += m.weight.size * (32 // m.bits - 1)
    return 4 * n


def _to_float32(model) -> None:
    """Cast every floating parameter to float32 (CPU kernels for fp16/bf16 are 7-40x slower)."""
    import mlx.core as mx
    from mlx.utils import tree_map

    floats = (mx.float16, mx.bfloat16)
    model.update(tree_map(lambda p: p.astype(mx.float32) if p.dtype in floats else p, model.parameters()))


def load(spec: str = "default", home=None, weights: str = None):
    """(model, tokenizer) for 'default', an mlx-lm folder, a .gguf or an HF repo id."""
    import mlx.core as mx
    from mlx_lm.utils import dequantize_model
    from mlx_lm.utils import load as mlx_load

    from . import layout, qlinear

    path = resolve(spec, home)
    try:
        model, tokenizer = mlx_load(path)
    except (FileNotFoundError, ValueError, OSError) as e:
        raise UserError(f"could not load model {spec!r}: {_first_line(e)}") from None
    except Exception as e:  # huggingface_hub errors (offline, unknown repo) have no common base here
        if type(e).__module__.startswith(("huggingface_hub", "requests", "urllib3")):
            raise UserError(f"could not fetch {spec!r} from the Hugging Face hub: {_first_line(e)}") from None
        if isinstance(e, JUNK_ERRORS):  # a damaged folder: torn safetensors, config without its fields
            raise UserError(f"could not load model {spec!r}: the folder is damaged or incomplete "
                            f"({type(e).__name__}: {_first_line(e)})") from None
        raise
    _check_chat_template(tokenizer, spec)
    policy = weights or weight_policy(model)
    if policy == "fp32":
        dequantize_model(model)
    if backend() == "cpu":
        _to_float32(model)  # float32 scales and biases too: what qmm.c reads
        qlinear.use_kernel(model)  # quantized layers left: qmm.c for decode, BLAS on a dequantized layer for prefill
    mx.eval(model.parameters())
    if layout.enabled():
        layout.row_major(model)  # x @ W, not x @ W.T: faster one-row products on the CPU (layout.py)
    model.justfit_weights = policy
    model.justfit_path = path
    return model, tokenizer
