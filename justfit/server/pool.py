"""Several models under one memory budget: the models `justfit serve` can serve, each loaded on first use.

A `Served` is one model: its names, and while loaded its Runtime and Worker. The `ModelPool` holds them all
under the server's memory budget (phaseswap's Budget: the byte limit and the live check of available
memory). Before a model loads, or takes a request, the weights, KV pages and workspace of every loaded model
must fit: when they do not, the least recently used idle model is unloaded first (its worker closes, which
checkpoints its persisted sessions, so a later turn on it restores its KV from disk); a request that cannot
fit even then gets 503 with retry-after. Loads and unloads are serialized, and one lock is shared by every
worker so that only one thread at a time runs MLX.
"""

import threading
import time
from pathlib import Path
from typing import Callable, List, Optional

from ..errors import MemoryBudgetError, UserError
from .errors import APIError
from .prompts import check_logit_bias, context_length, stops
from .worker import Job, Worker

RETRY_S = 5  # retry-after of a request the budget cannot hold while other models are busy


class Served:
    """One model the server serves: model_id, names, its folder (or GGUF file: `gguf`), and while loaded rt,
    worker, context, n_vocab."""

    def __init__(self, spec: str, path: str, metrics, primary: bool = False):
        self.spec, self.path, self.metrics = spec, path, metrics
        self.gguf = path.lower().endswith(".gguf")  # a GGUF file: converted into the cache when it first loads
        self.model_id = (Path(path).stem if self.gguf else Path(path).name) or spec
        self.names = {self.model_id, spec, path} | ({"default"} if primary else set())
        self.rt = self.worker = None
        self.context: Optional[int] = None
        self.n_vocab: Optional[int] = None
        self.started = time.time()
        self.last_used = 0.0
        self.workspace = 0  # the prefill workspace of the request admitted last, while it runs
        self.loads, self.load_s = 0, 0.0

    @property
    def loaded(self) -> bool:
        return self.rt is not None

    @property
    def busy(self) -> bool:
        return self.worker is not None and self.worker.queue_length > 0

    def attach(self, rt, worker):
        from ..models.vocab import vocab_size

        self.rt, self.worker = rt, worker
        self.context, self.n_vocab = context_length(rt), vocab_size(rt.model)

    def weight_bytes(self) -> int:
        """Weights resident now (every non-KV PhaseSwap component); a folder's file sizes before the first load."""
        if self.rt is None:
            return estimate_weights(self.path)
        return sum(c.size() for c in self.rt.phaseswap.components.values() if c.kind != "kv" and c.resident)

    def memory(self) -> dict:
        """Bytes this model holds: weights, KV (the engine's page pool and speed copies), KV by session,
        and the workspace of the running prefill."""
        if self.rt is None:
            return {"weights": 0, "kv": 0, "kv_by_session": {}, "workspace": 0, "total": 0}
        engine = self.rt.engine
        kv = engine.used_bytes() if engine is not None else 0
        sessions = {name: s.resident_bytes() for name, s in list(self.worker.sessions.items())}
        weights, ws = self.weight_bytes(), self.workspace if self.busy else 0
        return {"weights": weights, "kv": kv, "kv_by_session": sessions, "workspace": ws, "total": weights + kv + ws}

    def draft(self) -> Optional[dict]:
        """The draft model's share while loaded (its bytes, part of `weights`) and the engine's drafting
        counts; None without one."""
        parts = [c for c in self.rt.phaseswap.components.values() if c.kind == "draft-model"] if self.rt else []
        if not parts:
            return None
        counts = dict(self.rt.engine.counts) if self.rt.engine is not None else {}
        return {"bytes": sum(c.size() for c in parts if c.resident), **counts}

    def check_model(self, name: str, status: int = 400):
        if name not in self.names:
            raise APIError(status, f"model {name!r} is not served here (GET /v1/models)", "model", "model_not_found")

    def submit(self, req, ids, max_tokens: int, grammar: Optional[str]) -> Job:
        """Queue one reply for a validated request."""
        options = {"temperature": req.temperature, "top_p": req.top_p, "top_k": getattr(req, "top_k", None), "seed": req.seed,
                   "stop": stops(req.stop) or None, "logit_bias": check_logit_bias(req.logit_bias, self.n_vocab) or None,
                   "frequency_penalty": req.frequency_penalty or None,
                   "presence_penalty": req.presence_penalty or None, "repetition_penalty": getattr(req, "repetition_penalty", None)}
        persist = req.prompt_cache_retention == "24h"
        if req.prompt_cache_key is not None:
            from ..statetrans.manifest import check_name

            try:
                check_name(req.prompt_cache_key)
            except UserError as e:
                raise APIError(400, f"prompt_cache_key: {e}", "prompt_cache_key", "invalid_value") from None
        self.last_used = time.monotonic()
        return self.worker.submit(Job(list(ids), max_tokens, options, req.prompt_cache_key, persist, grammar))


def estimate_weights(path: str) -> int:
    """Bytes a model folder's weights take once loaded: its safetensors' tensors by their headers, 16-bit
    floats twice over on the CPU backend (load.py widens them to float32); a GGUF file's size before it is
    converted (a guess: the pool checks again with the loaded bytes)."""
    import json
    import struct

    from ..models import backend

    if Path(path).is_file():
        return Path(path).stat().st_size
    widen = 2 if backend() == "cpu" else 1
    total = 0
    for f in sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        for t in header.values():
            size = t["data_offsets"][1] - t["data_offsets"][0]
            total += size * (widen if t["dtype"] in ("F16", "BF16") else 1)
    return total


class ModelPool:
    """Every served model, loaded on first use and unloaded least recently used first under one budget."""

    def __init__(self, make_runtime: Callable[[str], object], make_worker: Callable[[object], Worker],
                 budget_bytes: Optional[int] = None, home=None):
        from ..phaseswap.budget import Budget

        self.make_runtime, self.make_worker, self.home = make_runtime, make_worker, home
        self.budget = Budget(budget_bytes)
        self.served: List[Served] = []
        self.mlx = threading.RLock()  # held by whichever thread runs MLX: a worker's step, a load, an unload
        self.changing = threading.Lock()  # one load or unload at a time
        self.events: List[str] = []  # "load NAME" / "unload NAME", in order (what /justfit/models shows last)

    def add(self, served: Served) -> Served:
        if not any(s.path == served.path for s in self.served):
            self.served.append(served)
            return served
        return next(s for s in self.served if s.path == served.path)

    def find(self, name: str) -> Optional[Served]:
        bare = name[:-len(":latest")] if name.endswith(":latest") else name
        return next((s for s in self.served if name in s.names or bare in s.names), None)

    def resident(self, exclude: Optional[Served] = None) -> int:
        return sum(s.memory()["total"] for s in self.served if s.loaded and s is not exclude)

    # -- loading -----------------------------------------------------------------------------------
    def ensure(self, s: Served, need: int = 0, progress: Optional[Callable[[dict], None]] = None) -> Served:
        """Make `s` loaded with room for `need` more bytes (a request's KV and workspace), unloading idle
        models least recently used first; MemoryBudgetError when that is not enough."""
        with self.changing:
            new = 0 if s.loaded else estimate_weights(s.path)
            self._make_room(s, new + need, progress)
            if not s.loaded:
                self._load(s, progress)
                self._make_room(s, need, progress)  # the estimate was a guess: check again with the real bytes
        s.last_used = time.monotonic()
        return s

    def _load(self, s: Served, progress):
        start = time.perf_counter()
        folder = s.path
        if s.gguf:  # converted once into the cache, outside the MLX lock
            from ..models import import_gguf

            if progress:
                progress({"status": "converting", "model": s.model_id, "file": s.path})
            folder = str(import_gguf(s.path, self.home))
        if progress:
            progress({"status": "loading", "model": s.model_id})
        with self.mlx:
            rt = self.make_runtime(folder)
        s.attach(rt, self.make_worker(rt))
        s.loads += 1
        s.load_s = time.perf_counter() - start
        self.events.append(f"load {s.model_id}")
        if progress:
            progress({"status": "loaded", "model": s.model_id, "seconds": round(s.load_s, 3),
                      "weights_bytes": s.weight_bytes()})

    def _make_room(self, s: Served, need: int, progress):
        while self.budget.shortfall(self.resident(exclude=s), s.memory()["total"] + need, 0) > 0:
            idle = sorted((o for o in self.served if o.loaded and o is not s and not o.busy), key=lambda o: o.last_used)
            if not idle:
                held = self.resident(exclude=s)
                limit = f"{self.budget.limit / 1e6:.1f} MB" if self.budget.limit is not None else "the available memory"
                raise MemoryBudgetError(f"{s.model_id} needs {(s.memory()['total'] + need) / 1e6:.1f} MB beside "
                                        f"{held / 1e6:.1f} MB held by busy models, over {limit}")
            if progress:
                progress({"status": "unloading", "model": idle[0].model_id, "reason": f"room for {s.model_id}"})
            self._unload(idle[0])

    def unload(self, s: Served) -> bool:
        """Unload `s` now (its sessions checkpointed); False when it was not loaded."""
        with self.changing:
            if not s.loaded:
                return False
            self._unload(s)
            return True

    def _unload(self, s: Served):
        from ..phaseswap.residency import release_memory

        worker, rt = s.worker, s.rt
        worker.close()  # stops its thread; persisted sessions are checkpointed, so their KV restores from disk
        s.rt = s.worker = None
        with self.mlx:
            rt.phaseswap.enter("tool")
            rt.phaseswap.release()
            del rt, worker
            release_memory()
        self.events.append(f"unload {s.model_id}")

    def close(self):
        for s in self.served:
            if s.loaded:
                s.worker.close()

    def report(self) -> dict:
        """For GET /justfit/models: every model, whether it is loaded, its bytes; the budget and the total."""
        rows = [{"id": s.model_id, "loaded": s.loaded, "busy": s.busy, "loads": s.loads,
                 "load_s": round(s.load_s, 3),
                 "restore_s": round(s.worker.restore_s, 3) if s.worker else None, "released": bool(s.worker and s.worker.released),
                 "keep_alive_s": s.worker.idle_release if s.worker else None, "bytes": s.memory(),
                 "draft": s.draft()} for s in self.served]
        return {"models": rows, "budget_bytes": self.budget.limit, "resident_bytes": self.resident(),
                "events": self.events[-20:]}
