"""What Ollama's clients ask before they generate: is the server up (`/`, answered in page.py, which
serves browsers the web page there), its version, the models it
has (`/api/tags`), what one of them is (`/api/show`) and which are loaded (`/api/ps`). A served model's
Ollama name is its id with the tag `latest`. Listing and showing read the model's folder and never load it:
a client that looks at every model must not evict the ones in use."""

import hashlib
import json
import struct
import time
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Optional

from fastapi import APIRouter, Request

from .errors import APIError
from .ollama_schema import ShowBody, read_body
from .prompts import DEFAULT_CONTEXT

router = APIRouter()
VERSION = "0.12.0"  # the Ollama API version whose shapes these routes follow
TAG = ":latest"
FOREVER = 300 * 365 * 24 * 3600.0  # keep_alive < 0 (never released): Ollama reports a far-off expiry


def iso(t: float) -> str:
    """A time as Ollama writes it (RFC 3339, UTC)."""
    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


def ollama_name(srv) -> str:
    return srv.model_id + TAG


def check_model(srv, name: Optional[str]):
    """A served model under any of its names, with or without ':latest'; else Ollama's 404."""
    if srv.pool.find(name or "") is None:
        raise APIError(404, f"model '{name}' not found")


@lru_cache(maxsize=4)
def _files(folder: str):
    """(bytes on disk, digest, config, parameter count) of a model folder. The digest hashes the
    files' names, sizes and times: it changes when the model does, and costs no read of the weights."""
    path = Path(folder)
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else []
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    params = sum(_parameters(f, config.get("quantization") or {}) for f in files if f.suffix == ".safetensors")
    modified = max((f.stat().st_mtime for f in files), default=time.time())
    return sum(f.stat().st_size for f in files), h.hexdigest(), config, params, modified


def _parameters(file: Path, quant: dict) -> int:
    """Parameters in one safetensors file, from its header alone: a quantized weight (uint32 words with
    `scales` beside it) holds 32/bits values per word; its scales and biases are not parameters."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    total = 0
    for name, t in header.items():
        base = name.rsplit(".", 1)[0]
        quantized = f"{base}.scales" in header
        if quantized and name.endswith((".scales", ".biases")):
            continue
        numel = 1
        for d in t["shape"]:
            numel *= d
        if quantized and t["dtype"] == "U32":
            numel = numel * 32 // (quant.get(base, {}).get("bits") or quant.get("bits") or 4)
        total += numel
    return total


def _size(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _info(srv):
    folder = srv.path if Path(srv.path).is_dir() else ""
    return _files(folder) if folder else (0, hashlib.sha256(srv.model_id.encode()).hexdigest(), {}, 0, srv.started)


def _template(srv) -> str:
    """The chat template (Jinja) the tokenizer renders with: the loaded tokenizer's, else the folder's
    `tokenizer_config.json` or `chat_template.jinja`."""
    if srv.rt is not None:
        return getattr(srv.rt.tokenizer, "chat_template", None) or ""
    folder = Path(srv.path)
    try:
        if (folder / "chat_template.jinja").is_file():
            return (folder / "chat_template.jinja").read_text()
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return ""
    template = config.get("chat_template") or ""
    return template if isinstance(template, str) else ""


def details(srv) -> dict:
    _, _, config, params, _ = _info(srv)
    family = config.get("model_type", "unknown")
    quant = config.get("quantization") or {}
    level = f"Q{quant['bits']}" if quant.get("bits") else str(config.get("torch_dtype", "F16")).upper()
    return {"parent_model": "", "format": "safetensors", "family": family, "families": [family],
            "parameter_size": _size(params) if params else "unknown", "quantization_level": level}


@router.get("/api/version")
async def version():
    return {"version": VERSION}


@router.get("/api/tags")
async def tags(request: Request):
    rows = []
    for srv in request.app.state.server.models():
        size, digest, _, _, modified = _info(srv)
        name = ollama_name(srv)
        rows.append({"name": name, "model": name, "modified_at": iso(modified), "size": size,
                     "digest": digest, "details": details(srv)})
    return {"models": rows}


@router.post("/api/show")
async def show(request: Request):
    body = await read_body(request, ShowBody)
    srv = request.app.state.server
    name = body.model or body.name
    if not name:
        raise APIError(400, "model is required")
    check_model(srv, name)
    srv = srv.pool.find(name)
    _, _, config, params, modified = _info(srv)
    context = srv.context or int(config.get("max_position_embeddings") or DEFAULT_CONTEXT)  # as context_length reads it
    arch = config.get("model_type", "unknown")
    info = {"general.architecture": arch, "general.parameter_count": params, f"{arch}.context_length": context}
    for key, ours in (("embedding_length", "hidden_size"), ("block_count", "num_hidden_layers"),
                      ("attention.head_count", "num_attention_heads"),
                      ("attention.head_count_kv", "num_key_value_heads"), ("vocab_size", "vocab_size")):
        if ours in config:
            info[f"{arch}.{key}"] = config[ours]
    return {"modelfile": f"# served by JustFit\nFROM {srv.path}\nPARAMETER num_ctx {context}\n",
            "parameters": f"num_ctx {context}\ntemperature 0.8\ntop_k 40\ntop_p 0.9",
            "template": _template(srv), "details": details(srv), "model_info": info,
            "capabilities": ["completion", "tools"],
            "modified_at": iso(modified)}


@router.get("/api/ps")
async def ps(request: Request):
    """The models whose weights are loaded, most recently used first; one leaves once keep_alive (or
    --idle-release) released it or the budget unloaded it for another."""
    rows = []
    for srv in sorted(request.app.state.server.loaded(), key=lambda s: -s.last_used):
        worker = srv.worker
        if worker is None or worker.released:
            continue
        keep = worker.idle_release
        expires = (time.time() if srv.busy else worker.idle_since) + (FOREVER if keep is None else keep)
        name = ollama_name(srv)
        _, digest, _, _, _ = _info(srv)
        rows.append({"name": name, "model": name, "size": srv.memory()["total"], "digest": digest,
                     "details": details(srv), "expires_at": iso(expires), "size_vram": 0,
                     "context_length": srv.context})
    return {"models": rows}
