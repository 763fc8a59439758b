"""Each protocol's error envelope, API-key auth and the request body limit, for every route.

Every failure a client can cause answers a 4xx in the envelope of the protocol its path belongs to
(ENVELOPES: OpenAI's `{"error": {"message", "type", "param", "code"}}` unless a prefix says otherwise,
Anthropic's `{"type": "error", "error": {"type", "message"}}` under /v1/messages, Ollama's `{"error": "..."}`
under /api/); the server's own
failures answer the same envelope with 500 and never a traceback.
"""

import hmac
import json
import logging
from typing import Optional

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse

from .limits import MAX_DEPTH, MAX_INT_DIGITS, LimitError

log = logging.getLogger("justfit.server")
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
         415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
         503: "overloaded_error"}


class APIError(Exception):
    """A failure to report to the client in OpenAI's envelope."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 retry_after: Optional[int] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after


def envelope(status: int, message: str, param=None, code=None) -> dict:
    """The OpenAI error body."""
    return {"error": {"message": message, "type": TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                   503: "overloaded_error", 504: "timeout_error", 408: "timeout_error", 529: "overloaded_error"}


def anthropic_envelope(status: int, message: str, param=None, code=None) -> dict:
    """Anthropic's error body (the Messages API): a type per status, the message; no param or code."""
    return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "invalid_request_error"),
                                       "message": message}}


def ollama_envelope(status: int, message: str, param=None, code=None) -> dict:
    """Ollama's error body (its /api/ routes): the message alone."""
    return {"error": message}


# The envelope of each protocol, by path prefix (the first that matches); OpenAI's elsewhere.
ENVELOPES = (("/v1/messages", anthropic_envelope), ("/api/", ollama_envelope))


def envelope_for(path: str):
    """The envelope function for a request path."""
    return next((f for prefix, f in ENVELOPES if path.startswith(prefix)), envelope)


def error_body(path: str, status: int, message: str, param=None, code=None) -> dict:
    return envelope_for(path)(status, message, param, code)


def error_response(e: APIError, path: str = "") -> JSONResponse:
    headers = {"retry-after": str(e.retry_after)} if e.retry_after else None
    return JSONResponse(error_body(path, e.status, e.message, e.param, e.code), e.status, headers=headers)


def _param(loc) -> Optional[str]:
    """'messages[0].role' from pydantic's ('body', 'messages', 0, 'role')."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not str(part).startswith(("function-", "literal[", "list[", "str", "dict[", "union[")):
            out += f".{part}" if out else str(part)
    return out or None


async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    """Pydantic's complaint as one readable line naming the field."""
    body = envelope_for(request.url.path)
    errs = exc.errors()
    first = errs[0] if errs else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        return JSONResponse(body(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}",
                                     code="invalid_json"), 400)
    param = _param(first.get("loc", ()))
    limit = first.get("ctx", {}).get("error")
    if isinstance(limit, LimitError):  # limits.py: the message says which limit, the path where
        param = ".".join(filter(None, [param, limit.path])).replace(".[", "[") or None
        if param and len(param) > 120:  # a path as deep as the nesting it reports: keep its start
            param = param[:120] + "..."
        return JSONResponse(body(400, f"{param + ': ' if param else ''}{limit.message}", param,
                                     "invalid_value"), 400)
    if first.get("type") == "missing" and param:
        msg = f"missing required field '{param}'"
    else:
        msg = f"{param + ': ' if param else ''}{first['msg']}"
    more = f" (and {len(errs) - 1} more problem{'s' if len(errs) > 2 else ''})" if len(errs) > 1 else ""
    return JSONResponse(body(400, msg + more, param, "invalid_value"), 400)


async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc, request.url.path)


async def on_http(request: Request, exc: HTTPException) -> JSONResponse:
    body = envelope_for(request.url.path)
    if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI could not parse the body
        why = exc.__cause__
        if isinstance(why, ClientDisconnect):  # conns.py closed it: the body did not come in time
            return JSONResponse(body(408, "the request body was not received in time", code="request_timeout"), 408)
        if isinstance(why, RecursionError):
            why = f"nested deeper than Python's JSON parser allows (the limit is {MAX_DEPTH} levels)"
        elif isinstance(why, ValueError) and "digits" in str(why):
            why = f"an integer longer than {MAX_INT_DIGITS} digits"
        return JSONResponse(body(400, f"the request body is not valid JSON: {why}", code="invalid_json"), 400)
    msg = {404: "no such route; see /v1/models, /v1/chat/completions, /v1/completions, /health, /metrics",
           405: "method not allowed on this route"}.get(exc.status_code, str(exc.detail))
    return JSONResponse(body(exc.status_code, msg), exc.status_code)


class Guard:
    """ASGI middleware: API key (constant-time; `Authorization: Bearer KEY`, or Anthropic's `x-api-key: KEY`),
    body size limit, JSON content, before any route runs."""

    OPEN = ("/health", "/")  # and the web page's files (OPEN_PREFIX): they hold no secret
    OPEN_PREFIX = "/ui/"

    def __init__(self, app, api_key: Optional[str], max_body: int):
        self.app, self.max_body = app, max_body
        self.key = f"Bearer {api_key}".encode() if api_key else None
        self.raw_key = api_key.encode() if api_key else None

    def _authorized(self, headers: dict) -> bool:
        bearer = hmac.compare_digest(headers.get(b"authorization", b""), self.key)
        return hmac.compare_digest(headers.get(b"x-api-key", b""), self.raw_key) or bearer

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers, path = dict(scope["headers"]), scope["path"]
        if self.key is not None and path not in self.OPEN and not path.startswith(self.OPEN_PREFIX) \
                and not self._authorized(headers):
            return await send_error(send, 401, "invalid or missing API key: send 'Authorization: Bearer KEY' "
                                    "or 'x-api-key: KEY'", "invalid_api_key", path)
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return await send_error(send, 413, f"request body over {self.max_body} bytes", "request_too_large", path)
        seen = 0

        async def limited():
            nonlocal seen
            msg = await receive()
            seen += len(msg.get("body", b""))
            if seen > self.max_body:
                raise APIError(413, f"request body over {self.max_body} bytes", code="request_too_large")
            return msg

        await self.app(scope, limited, send)


async def send_error(send, status: int, message: str, code: Optional[str], path: str = ""):
    body = json.dumps(error_body(path, status, message, None, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def install(app, api_key: Optional[str], max_body: int):
    """Register the handlers and the guard on a FastAPI app."""
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(HTTPException, on_http)
    app.add_middleware(Guard, api_key=api_key, max_body=max_body)
    app.state.api_key_required = api_key is not None  # the web page asks for the key when set
