"""`justfit serve`: the FastAPI app around one Runtime, and uvicorn running it until SIGINT/SIGTERM."""

import ipaddress
import logging
import time
from typing import Optional

from ..errors import MemoryBudgetError, UserError
from .errors import APIError, send_error
from .metrics import Metrics
from .worker import Job, Worker

log = logging.getLogger("justfit.server")
MAX_BODY = 8 << 20  # 8 MiB: a 128k-token conversation as JSON fits with room to spare


class Server:
    """What the routes share: the model pool (every served model, pool.py), the metrics and the gate. The
    first model is the primary one: `rt`, `worker`, `model_id`... are its (routes that name no model use it)."""

    def __init__(self, rt, persist: bool = False, max_queue: int = 64, idle_release: Optional[float] = None,
                 models: tuple = (), memory_budget=None, catalog: bool = False, draft_model: Optional[str] = None):
        from .pool import ModelPool, Served

        self.metrics, self.started, self.home = Metrics(), time.time(), rt.home
        budget = rt.memory_budget if memory_budget is None else memory_budget
        self.idle_release = idle_release

        def make_runtime(path):
            from ..runtime import Runtime

            draft = draft_model if path == self.primary.path else None  # a part of its target, reloaded with it
            return Runtime(model=path, kv=rt.kv, memory_budget=budget, home=rt.home, draft_model=draft)

        def make_worker(model_rt):
            return Worker(model_rt, self.metrics, max_queue, idle_release, persist, lock=self.pool.mlx)

        self.pool = ModelPool(make_runtime, make_worker, budget, rt.home)
        path = str(getattr(rt.model, "justfit_path", None) or rt.model_spec)
        self.primary = self.pool.add(Served(str(rt.model_spec), path, self.metrics, primary=True))
        self.primary.attach(rt, make_worker(rt))
        self.primary.last_used = time.monotonic()
        for spec, model_path in models:
            self.pool.add(Served(spec, model_path, self.metrics))
        if catalog:  # every model cached under JUSTFIT_HOME/models is served by its folder name
            for row in _cached_models(self.pool.served, rt.home):
                self.pool.add(Served(row["name"], row["path"], self.metrics))
        self.gate = None  # conns.Gate, when serve() runs the app

    # the primary model's parts, for the routes that serve it alone
    rt = property(lambda self: self.primary.rt or self._load(self.primary).rt)
    worker = property(lambda self: self.primary.worker or self._load(self.primary).worker)
    model_id = property(lambda self: self.primary.model_id)
    names = property(lambda self: self.primary.names)
    context = property(lambda self: self.primary.context or self._load(self.primary).context)
    n_vocab = property(lambda self: self.primary.n_vocab or self._load(self.primary).n_vocab)

    def _load(self, s):
        try:
            return self.pool.ensure(s)
        except MemoryBudgetError as e:
            raise APIError(503, f"out of memory budget: {e}", code="memory_budget", retry_after=5) from None

    def models(self) -> list:
        """Every model this server serves (pool.Served: `model_id`, `rt`, `worker` and `metrics`; rt and worker
        are None while a model is not loaded)."""
        return list(self.pool.served)

    def loaded(self) -> list:
        return [s for s in self.pool.served if s.loaded]

    def find(self, name: str, status: int = 400):
        """The served model of that name (its Ollama name with ':latest' too); else today's model_not_found."""
        s = self.pool.find(name)
        if s is None:
            served = ", ".join(repr(m.model_id) for m in self.pool.served)
            raise APIError(status, f"model {name!r} is not served here; this server serves {served} "
                           "(GET /v1/models)", "model", "model_not_found")
        return s

    async def use(self, name: Optional[str], status: int = 400):
        """The model a request names (the primary one for None), loaded with room made under the budget."""
        return await self.ready(self.primary if name is None else self.find(name, status))

    async def ready(self, s, prompt_tokens: int = 0):
        """`s` loaded with room under the budget for a prompt of prompt_tokens (its KV and first prefill
        chunk's workspace), idle models unloaded for it; 503 with retry-after when it cannot fit. Every API
        calls it once the prompt is tokenized, before queueing it."""
        import asyncio

        if s.loaded and not self._short(s, prompt_tokens):
            s.last_used = time.monotonic()
            return s
        try:
            return await asyncio.to_thread(self.pool.ensure, s, self._need(s, prompt_tokens))
        except MemoryBudgetError as e:
            raise APIError(503, f"out of memory budget: {e}", code="memory_budget", retry_after=5) from None
        except UserError as e:  # the model's files on this machine (a broken GGUF, a folder gone): the operator's to fix
            raise APIError(500, f"model {s.model_id!r} could not be loaded: {e}", "model", "model_load_failed") from None

    def _need(self, s, prompt_tokens: int) -> int:
        """KV bytes of a prompt on a loaded model plus its first prefill chunk's workspace (0 before it
        loads: its engine knows its page sizes)."""
        from ..engine.runner import PREFILL_STEP, prefill_workspace

        engine = s.rt.engine if s.loaded else None
        if engine is None or not prompt_tokens:
            return 0
        s.workspace = prefill_workspace(s.rt.model, min(PREFILL_STEP, prompt_tokens), prompt_tokens, head=True)
        return engine.kv.seq_bytes(prompt_tokens) + s.workspace

    def _short(self, s, prompt_tokens: int) -> bool:
        return self.pool.budget.shortfall(self.pool.resident(exclude=s), s.memory()["total"] + self._need(s, prompt_tokens), 0) > 0

    def check_model(self, name: str, status: int = 400):
        self.find(name, status)

    def submit(self, req, ids, max_tokens: int, grammar: Optional[str]) -> Job:
        """Queue one reply on the primary model (routes that resolved a model call its Served.submit)."""
        if not self.primary.loaded:
            self._load(self.primary)
        return self.primary.submit(req, ids, max_tokens, grammar)

    def account(self, request, job: Job, stats: dict):
        """Note a finished reply in the request's log line (the worker counts it in the metrics)."""
        gen, cached = stats.get("generated_tokens", 0), stats.get("reused_tokens", 0)
        note = request.scope.setdefault("state", {})
        note["log"] = f"prompt={len(job.prompt)} cached={cached} completion={gen} " \
                      f"queued={stats.get('queue_s', 0.0):.2f}s total={time.perf_counter() - job.queued_at:.2f}s"


def _cached_models(served, home) -> list:
    """list_models' rows but the folders a served GGUF converts into: a GGUF served by name (--models-dir) is
    served once, not again under its cache folder's name after a restart."""
    from ..models import gguf_cache_name, list_models

    converted = set()
    for s in served:
        if s.gguf:
            try:
                converted.add(gguf_cache_name(s.path))
            except OSError:  # unreadable now: its load will say why
                pass
    return [row for row in list_models(home) if row["name"] not in converted]


def create_app(rt, api_key: Optional[str] = None, cors: Optional[str] = None, persist: bool = False,
               max_body: int = MAX_BODY, max_queue: int = 64, idle_release: Optional[float] = None,
               models: tuple = (), memory_budget=None, catalog: bool = False, draft_model: Optional[str] = None):
    """The ASGI app serving `rt` first, and `models` ((spec, folder) pairs) and, with catalog, every cached
    model, each loaded on first use under one memory budget (the worker threads stop on shutdown).
    draft_model: the spec `rt` was built with as its draft model, so that a reload of `rt`'s model brings
    its drafter back."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI

    from . import errors
    from .memory import router as memory_router
    from .messages import router as messages_router
    from .ollama import router as ollama_router
    from .ollama_info import router as ollama_info_router
    from .page import router as page_router
    from .responses import router as responses_router
    from .routes import router

    from .models_routes import router as models_router

    server = Server(rt, persist, max_queue, idle_release, models, memory_budget, catalog, draft_model)

    @asynccontextmanager
    async def lifespan(_app):
        yield
        server.pool.close()  # after uvicorn drained the open requests: sessions are checkpointed
        log.info("stopped; sessions checkpointed")

    app = FastAPI(title="JustFit", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.include_router(router)
    app.include_router(messages_router)
    app.include_router(ollama_router)
    app.include_router(ollama_info_router)
    app.include_router(responses_router)
    app.include_router(models_router)
    app.include_router(page_router)
    app.include_router(memory_router)
    errors.install(app, api_key, max_body)
    if cors:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=[o.strip() for o in cors.split(",")],
                           allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["authorization", "content-type", "x-api-key", "anthropic-version",
                                          "anthropic-beta", "anthropic-dangerous-direct-browser-access"])
    app.add_middleware(LogRequests, metrics=server.metrics)
    return app


class LogRequests:
    """ASGI middleware: one line per request when its response ends (streams included)."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [0]

        async def logged(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, logged)
        except Exception as e:  # noqa: BLE001  (a bug of ours: one envelope and one log line, no traceback)
            log.error("internal error on %s: %s: %s", scope["path"], type(e).__name__, e, exc_info=log.isEnabledFor(logging.DEBUG))
            if not status[0]:
                status[0] = 500
                await send_error(send, 500, f"internal error: {type(e).__name__}: {e}", None, scope["path"])
        finally:
            route = scope["path"] if scope["path"] in ROUTES else "other"
            self.metrics.request(route, status[0] or 499)
            extra = scope.get("state", {}).get("log", "")
            log.info("%s %s %s %.3fs %s", scope["method"], scope["path"], status[0] or 499,
                     time.perf_counter() - start, extra)


ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/v1/messages",
          "/v1/messages/count_tokens", "/api/chat", "/api/generate", "/api/tags", "/api/show", "/api/ps",
          "/api/version", "/", "/v1/responses", "/justfit/models", "/justfit/memory", "/justfit/memory/events", "/justfit/sessions")


def check_bind(host: str, api_key: Optional[str]):
    """Refuse to listen beyond loopback without an API key."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not api_key:
        raise UserError(f"refusing to serve on {host} without --api-key: anyone who can reach it could use "
                        "the model; pass --api-key KEY (or JUSTFIT_API_KEY), or bind 127.0.0.1")


def serve(rt, host: str = "127.0.0.1", port: int = 8000, header_timeout: float = 10.0, body_timeout: float = 60.0,
          max_connections: int = 1000, max_client_connections: int = 256, **options):
    """Run until SIGINT/SIGTERM: uvicorn stops accepting, finishes open requests (5 s at most), then
    the lifespan checkpoints every session. Connections are held to conns.py's timeouts and caps and
    repeated warnings to logs.py's rate."""
    import uvicorn

    from . import logs
    from .conns import Gate, protocol_for

    check_bind(host, options.get("api_key"))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logs.install()
    app = create_app(rt, **options)
    gate = Gate(header_timeout, body_timeout, max_connections, max_client_connections)
    app.state.server.gate = gate
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, log_config=None,
                            http=protocol_for(gate), backlog=gate.backlog, timeout_graceful_shutdown=5, lifespan="on")
    server = uvicorn.Server(config)
    log.info("justfit serve: %s on http://%s:%d/v1 (Ctrl-C stops)", ", ".join(m.model_id for m in app.state.server.models()), host, port)
    try:
        server.run()
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
