"""The web page of `justfit serve`: `GET /` for a browser, its static files under /ui/, and the session
list it resumes and deletes (`/justfit/sessions`).

`/` answers a browser (an Accept that names text/html) with the page and every other client with Ollama's
"Ollama is running", which Ollama's clients read as "the server is up". The page and its files hold no
secret, so they load without the API key (errors.Guard lets `/` and /ui/ through); everything they call
needs it. Every response here carries SECURITY_HEADERS: scripts, styles and connections from this origin
only, no inline script, no framing.
"""

import asyncio
import time
from functools import lru_cache
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from .errors import APIError

router = APIRouter()
STATIC = Path(__file__).parent / "static"
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = {"content-security-policy": CSP, "x-content-type-options": "nosniff",
                    "referrer-policy": "no-referrer", "x-frame-options": "DENY"}


@lru_cache(maxsize=None)
def _file(name: str):
    """(bytes, content type) of a shipped static file; None for anything else (no paths, no other files)."""
    path = STATIC / name
    if "/" in name or name.startswith(".") or path.suffix not in TYPES or not path.is_file():
        return None
    return path.read_bytes(), TYPES[path.suffix]


def static_bytes() -> int:
    """Bytes of the page's files as shipped (what a browser downloads on a first visit)."""
    return sum(p.stat().st_size for p in STATIC.iterdir() if p.suffix in TYPES)


def _page(name: str, head: bool = False) -> Response:
    found = _file(name)
    if found is None:
        raise APIError(404, f"no file {name!r} in the page", code="not_found")
    body, media = found
    return Response(b"" if head else body, media_type=media, headers={**SECURITY_HEADERS, "cache-control": "no-cache"})


def wants_html(request: Request) -> bool:
    return "text/html" in request.headers.get("accept", "")


@router.get("/")
@router.head("/")
async def root(request: Request):
    if wants_html(request):
        return _page("index.html", head=request.method == "HEAD")
    return PlainTextResponse("Ollama is running", headers=SECURITY_HEADERS)


@router.get("/ui/config.json")
async def config(request: Request):
    """What the page needs before it has a key: whether it must ask for one."""
    required = bool(getattr(request.app.state, "api_key_required", False))
    return JSONResponse({"api_key_required": required}, headers=SECURITY_HEADERS)


@router.get("/ui/{name}")
async def static(name: str):
    return _page(name)


# -- sessions (prompt_cache_key) ---------------------------------------------------------------------
def _open_sessions(server) -> dict:
    """name -> (model, session) of the sessions the servers' workers hold open."""
    return {name: (m, s) for m in server.models() if m.worker is not None
            for name, s in list(m.worker.sessions.items())}


def _home(server, m):
    """Where a model's sessions are checkpointed: its runtime's home, the server's while it is not loaded."""
    return m.rt.home if m.rt is not None else server.home


def session_list(server) -> list:
    """Every session: those open in a worker and those checkpointed on disk, newest first."""
    from ..statetrans.manifest import list_manifests

    rows, opened = {}, _open_sessions(server)
    for m in server.models():
        for man in list_manifests(_home(server, m)):
            rows[man.name] = {"name": man.name, "model": m.model_id, "tokens": len(man.tokens),
                              "messages": len(man.messages), "updated": man.updated, "on_disk": True, "open": False,
                              "running": False}
    for name, (m, s) in opened.items():
        row = rows.setdefault(name, {"name": name, "model": m.model_id, "messages": len(s.messages),
                                     "updated": time.time(), "on_disk": False})
        row.update(tokens=len(s.tokens), open=True, running=s.running is not None)
    return sorted(rows.values(), key=lambda r: -r["updated"])


@router.get("/justfit/sessions")
async def list_sessions(request: Request):
    return JSONResponse({"sessions": session_list(request.app.state.server)}, headers=SECURITY_HEADERS)


def _find(server, name: str):
    """(model, open session or None, manifest or None) of a session; a 404 when there is none."""
    from ..errors import UserError
    from ..statetrans.manifest import read_manifest

    opened = _open_sessions(server)
    for m in server.models():
        try:
            man = read_manifest(_home(server, m), name)
        except UserError as e:
            raise APIError(400, str(e), "name", "invalid_value") from None
        s = opened[name][1] if name in opened and opened[name][0] is m else None
        if s is not None or man is not None:
            return m, s, man
    raise APIError(404, f"no session named {name!r}", "name", "not_found")


@router.get("/justfit/sessions/{name}")
async def get_session(name: str, request: Request):
    """A session's recorded messages and, for a history recorded as tokens only (chat requests send whole
    conversations), the tail of its text."""
    m, s, man = _find(request.app.state.server, name)
    tokens = list(s.tokens) if s is not None else list(man.tokens)
    messages = s.messages if s is not None else man.messages
    text = m.rt.tokenizer.decode(tokens[-4096:]) if tokens and not messages and m.rt is not None else ""
    return JSONResponse({"name": name, "model": m.model_id, "tokens": len(tokens),
                         "messages": [{"role": x["role"], "content": x.get("content", "")} for x in messages],
                         "text": text}, headers=SECURITY_HEADERS)


def _delete(m, s, name: str, home) -> bool:
    """Close the open session (under the engine's step lock, so no step runs on its pages meanwhile) and
    remove its manifest and pin; its pages go at the store's next garbage collection."""
    from ..statetrans.manifest import remove_manifest
    from ..statetrans.quota import set_pinned

    engine = m.rt.engine if m.rt is not None else None
    if s is not None:
        lock = engine.lock if engine is not None else None
        if lock is not None:
            lock.acquire()
        try:
            if s.running is not None:
                raise APIError(409, f"session {name!r} has a turn running; stop it first", "name", "busy")
            m.worker.sessions.pop(name, None)
            s.set_persist(False)  # closing must not write back what is being removed
            s.close()
        finally:
            if lock is not None:
                lock.release()
    removed = remove_manifest(home, name)
    set_pinned(home, name, False)
    return removed or s is not None


@router.delete("/justfit/sessions/{name}")
async def delete_session(name: str, request: Request):
    server = request.app.state.server
    m, s, _ = _find(server, name)
    await asyncio.to_thread(_delete, m, s, name, _home(server, m))
    return JSONResponse({"name": name, "deleted": True}, headers=SECURITY_HEADERS)
