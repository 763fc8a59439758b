"""`justfit serve`: the FastAPI app around one Runtime, and uvicorn running it until SIGINT/SIGTERM."""

import ipaddress
import logging
import time
from pathlib import Path
from typing import Optional

from ..errors import UserError
from .errors import APIError, send_error
from .metrics import Metrics
from .prompts import check_logit_bias, context_length, stops
from .worker import Job, Worker

log = logging.getLogger("justfit.server")
MAX_BODY = 8 << 20  # 8 MiB: a 128k-token conversation as JSON fits with room to spare


class Server:
    """What the routes share: the runtime, the worker, the metrics and the served model's names."""

    def __init__(self, rt, persist: bool = False, max_queue: int = 64, idle_release: Optional[float] = None):
        from ..models.vocab import vocab_size

        self.rt, self.metrics, self.started = rt, Metrics(), time.time()
        self.worker = Worker(rt, self.metrics, max_queue, idle_release, persist)
        path = getattr(rt.model, "justfit_path", None) or str(rt.model_spec)
        self.model_id = Path(str(path)).name or str(rt.model_spec)
        self.names = {self.model_id, str(rt.model_spec), "default", str(path)}
        self.context = context_length(rt)
        self.n_vocab = vocab_size(rt.model)
        self.gate = None  # conns.Gate, when serve() runs the app

    def models(self) -> list:
        """Every model this server serves, each with `model_id`, `rt`, `worker` and `metrics` (the memory
        view and /api/ps read these; one model today)."""
        return [self]

    def check_model(self, name: str, status: int = 400):
        if name not in self.names:
            raise APIError(status, f"model {name!r} is not served here; this server serves {self.model_id!r} "
                           "(GET /v1/models)", "model", "model_not_found")

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
        return self.worker.submit(Job(list(ids), max_tokens, options, req.prompt_cache_key, persist, grammar))

    def account(self, request, job: Job, stats: dict):
        """Note a finished reply in the request's log line (the worker counts it in the metrics)."""
        gen, cached = stats.get("generated_tokens", 0), stats.get("reused_tokens", 0)
        note = request.scope.setdefault("state", {})
        note["log"] = f"prompt={len(job.prompt)} cached={cached} completion={gen} " \
                      f"queued={stats.get('queue_s', 0.0):.2f}s total={time.perf_counter() - job.queued_at:.2f}s"


def create_app(rt, api_key: Optional[str] = None, cors: Optional[str] = None, persist: bool = False,
               max_body: int = MAX_BODY, max_queue: int = 64, idle_release: Optional[float] = None):
    """The ASGI app serving `rt` (the worker thread starts with the app and stops on shutdown)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI

    from . import errors
    from .messages import router as messages_router
    from .ollama import router as ollama_router
    from .ollama_info import router as ollama_info_router
    from .responses import router as responses_router
    from .routes import router

    server = Server(rt, persist, max_queue, idle_release)

    @asynccontextmanager
    async def lifespan(_app):
        yield
        server.worker.close()  # after uvicorn drained the open requests: sessions are checkpointed
        log.info("stopped; sessions checkpointed")

    app = FastAPI(title="JustFit", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.include_router(router)
    app.include_router(messages_router)
    app.include_router(ollama_router)
    app.include_router(ollama_info_router)
    app.include_router(responses_router)
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
          "/api/version", "/", "/v1/responses")


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
    log.info("justfit serve: %s on http://%s:%d/v1 (Ctrl-C stops)", app.state.server.model_id, host, port)
    try:
        server.run()
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
