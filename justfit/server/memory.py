"""Where each served model's memory goes, as JSON: `GET /justfit/memory` (one snapshot) and
`GET /justfit/memory/events` (server-sent events, one snapshot a second until the client goes).

The snapshot reads, never sets: the residency report (phase, budget, components), the KV page pool by
page format, each session's pages, the engine's speed copies, the checkpoints on disk and the metrics.
The worker thread changes these while a snapshot reads them, so a read that meets a dict changing size
is retried; a snapshot is a consistent view of each part, not of all parts at one instant.
MEMORY_VIEW.md describes every field.
"""

import asyncio
import json
import time
import weakref
from collections import deque

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from .page import SECURITY_HEADERS

router = APIRouter()
INTERVAL_S = 1.0  # between two events of the stream
TREND_S = 300  # how far back the throughput and TTFT trend goes
DISK_TTL_S = 5.0  # the checkpoints on disk are counted at most this often (a directory walk)
PAGE_KINDS = {"q": "sealed_quantized", "fp": "sealed_float", "open": "open"}


def _retry(read, tries: int = 5):
    """read() again when the worker thread changed a dict under it (RuntimeError: changed size)."""
    for i in range(tries):
        try:
            return read()
        except RuntimeError:
            if i == tries - 1:
                raise
            time.sleep(0.001)


def page_bytes(pool, pids=None) -> dict:
    """Bytes per page format over `pids` (every page when None), and how many of those pages wait on disk
    (restored lazily: their records hold a loader and no arrays yet)."""
    out = {name: 0 for name in PAGE_KINDS.values()}
    lazy, wanted = set(), None if pids is None else set(pids)
    for layer in pool.records:
        for pid, page in list(layer.items()):
            if wanted is not None and pid not in wanted:
                continue
            if page.k is None and page.loader is not None:
                lazy.add(pid)
            out[PAGE_KINDS.get(page.kind, page.kind)] = out.get(PAGE_KINDS.get(page.kind, page.kind), 0) + page.nbytes
    out["pages_on_disk_only"] = len(lazy)
    return out


def _cache_bytes(caches) -> tuple:
    """(float window, decode workspace) bytes of one sequence's layer caches."""
    window = sum(getattr(c, "window_nbytes", 0) or 0 for c in caches)
    memo = sum(getattr(getattr(c, "memo", None), "nbytes", 0) or 0 for c in caches)
    return window, memo


def session_row(name: str, s) -> dict:
    """One open session: its tokens and the bytes of its KV by format."""
    seq = s.seq
    kinds = page_bytes(seq.pool, list(seq.table))
    window, workspace = _cache_bytes(s.cache)
    return {"name": name, "tokens": len(s.tokens), "kv_tokens": s.kv_tokens, "pages": len(seq.table),
            "persisted": bool(s.persist), "running": s.running is not None,
            "bytes": {**{k: v for k, v in kinds.items() if k != "pages_on_disk_only"},
                      "float_window": window, "workspace": workspace},
            "pages_on_disk_only": kinds["pages_on_disk_only"]}


def kv_view(rt, worker) -> dict:
    """The KV pool as a whole, the engine's speed copies, and each open session."""
    from .metrics import pool_pages

    pool = rt.index.pool
    used, free = pool_pages(rt)
    kinds = page_bytes(pool)
    engine = rt.engine
    engine_bytes = engine.kv.used_bytes() if engine is not None else None
    pool_bytes = sum(v for k, v in kinds.items() if k != "pages_on_disk_only")
    index_pids = [pid for pid in list(rt.index.mem.values()) if pool.refs.get(pid) == 1]
    sessions = [session_row(n, s) for n, s in list(worker.sessions.items())]
    kv = rt.kv
    return {"format": {"bits": kv.bits, "format": kv.format, "page_size": kv.page_size,
                       "float_pages": kv.float_pages},
            "budget_bytes": rt.kv_budget(), "pages_used": used, "pages_free": free,
            "pool_bytes": pool_bytes, "by_format": kinds,
            "engine_bytes": engine_bytes,
            "workspace_bytes": None if engine_bytes is None else max(0, engine_bytes - pool_bytes),
            "prefix_cache": {"pages": len(index_pids), "bytes": sum(page_bytes(pool, index_pids)[k]
                                                                    for k in PAGE_KINDS.values())},
            "sessions": sessions}


class DiskCount:
    """Checkpoints on disk (session manifests and the page store's bytes), counted at most every
    DISK_TTL_S seconds: a snapshot a second must not walk the store a second."""

    def __init__(self):
        self.at, self.value = 0.0, None

    def get(self, rt) -> dict:
        now = time.monotonic()
        if self.value is None or now - self.at > DISK_TTL_S:
            self.value, self.at = self._count(rt), now
        return self.value

    @staticmethod
    def _count(rt) -> dict:
        from ..statetrans.manifest import list_manifests

        store = rt.index.store
        rows = []
        for m in list_manifests(rt.home):
            size = 0
            for p in m.pages + ([m.open_page] if m.open_page else []):
                try:
                    size += store.path(p["hash"]).stat().st_size
                except (OSError, KeyError):
                    pass
            rows.append({"name": m.name, "tokens": len(m.tokens), "pages": len(m.pages), "disk_bytes": size,
                         "updated": m.updated})
        try:
            total = store.usage()
        except OSError:
            total = None
        return {"store_bytes": total, "sessions": rows}


class Trend:
    """Tokens a second and mean time to first token over the last TREND_S seconds, from the metrics'
    running totals sampled at most once per INTERVAL_S (the samples start when the view is first read)."""

    def __init__(self):
        self.samples = deque(maxlen=int(TREND_S / INTERVAL_S) + 1)

    def sample(self, metrics) -> list:
        with metrics.lock:
            now = (time.time(), metrics.tokens["completion"], metrics.tokens["prompt"], metrics.ttft.sum,
                   metrics.ttft.n)
        if not self.samples or now[0] - self.samples[-1][0] >= INTERVAL_S * 0.9:
            self.samples.append(now)
        pts, prev = [], None
        for s in self.samples:
            if prev is not None and s[0] > prev[0]:
                dt, turns = s[0] - prev[0], s[4] - prev[4]
                pts.append({"t": round(s[0], 2), "completion_tokens_per_s": round((s[1] - prev[1]) / dt, 2),
                            "prompt_tokens_per_s": round((s[2] - prev[2]) / dt, 2),
                            "ttft_s": round((s[3] - prev[3]) / turns, 4) if turns else None})
            prev = s
        return pts


_state = weakref.WeakKeyDictionary()  # per served model (its Metrics object): its Trend and DiskCount


def _model_state(m):
    if m.metrics not in _state:
        _state[m.metrics] = (Trend(), DiskCount())
    return _state[m.metrics]


def _metrics_view(metrics) -> dict:
    with metrics.lock:
        prompt, cached = metrics.tokens["prompt"], metrics.tokens["cached"]
        return {"prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": metrics.tokens["completion"],
                "cached_ratio": round(cached / prompt, 4) if prompt else None,
                "turns": metrics.ttft.n, "ttft_mean_s": round(metrics.ttft.sum / metrics.ttft.n, 4)
                if metrics.ttft.n else None}


def unloaded_view(m) -> dict:
    """A served model that is not loaded (unloaded by keep_alive 0 or to make room for another): nothing
    resident; its checkpoints as last counted while it was loaded."""
    trend, disk = _model_state(m)
    return {"model": m.model_id, "loaded": False, "phase": "unloaded", "released": True,
            "budget": {"limit_bytes": None, "text": None, "resident_bytes": 0, "mlx_active_bytes": None},
            "components": [], "kv": None, "checkpoints": disk.value, "reuse": _metrics_view(m.metrics),
            "queue": None, "trend": trend.sample(m.metrics)}


def model_view(m) -> dict:
    """One served model's memory: phase, budget, components, KV, checkpoints, reuse and speed."""
    rt, worker = m.rt, m.worker
    if rt is None or worker is None:
        return unloaded_view(m)
    trend, disk = _model_state(m)
    res = _retry(rt.residency)
    components = [{k: c[k] for k in ("name", "kind", "bytes", "resident")} for c in res["components"]]
    return {"model": m.model_id, "loaded": True, "phase": res["phase"], "released": bool(worker.released),
            "budget": {"limit_bytes": res.get("budget_bytes"), "text": res.get("budget"),
                       "resident_bytes": res.get("resident_bytes"), "mlx_active_bytes": res.get("mlx_active_bytes")},
            "components": components, "kv": _retry(lambda: kv_view(rt, worker)),
            "checkpoints": disk.get(rt), "reuse": _metrics_view(m.metrics),
            "queue": worker.snapshot(), "trend": trend.sample(m.metrics)}


def snapshot(server) -> dict:
    """The memory view of every model `server` serves (see MEMORY_VIEW.md)."""
    return {"time": round(time.time(), 3), "models": [model_view(m) for m in server.models()]}


@router.get("/justfit/memory")
async def memory(request: Request):
    from fastapi.responses import JSONResponse

    return JSONResponse(snapshot(request.app.state.server), headers=SECURITY_HEADERS)


@router.get("/justfit/memory/events")
async def memory_events(request: Request):
    """One `data:` event a second, each a snapshot, until the client disconnects."""
    server = request.app.state.server

    async def events():
        while not await request.is_disconnected():
            yield f"data: {json.dumps(snapshot(server))}\n\n"
            await asyncio.sleep(INTERVAL_S)

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"cache-control": "no-cache", "x-accel-buffering": "no", **SECURITY_HEADERS})
