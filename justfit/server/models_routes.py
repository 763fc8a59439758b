"""JustFit's model routes: `GET /justfit/models` (every served model, loaded or not, and its bytes),
`POST /justfit/models/{name}/load` (a text/event-stream of progress events while it loads) and
`POST /justfit/models/{name}/unload` (its sessions checkpointed, its memory given back)."""

import asyncio
import json
import time

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from ..errors import MemoryBudgetError, UserError
from .errors import APIError

router = APIRouter()
BEAT_S = 0.5  # between two "loading" events while the weights load
BUSY_WAIT_S = 60.0  # an unload waits this long for the model's running requests to finish


@router.get("/justfit/models")
async def models(request: Request):
    return request.app.state.server.pool.report()


@router.post("/justfit/models/{name:path}/load")
async def load(name: str, request: Request):
    """Events: {"status": "unloading", ...} for each model released to make room, "converting" for a GGUF's
    first load, "loading" every half second, then "loaded" (seconds, weights_bytes) and "ready", or "error"
    (the 503's message, or why the model's files could not be loaded)."""
    srv = request.app.state.server
    served = srv.find(name, status=404)
    loop, events = asyncio.get_running_loop(), asyncio.Queue()

    def progress(event: dict):
        loop.call_soon_threadsafe(events.put_nowait, event)

    async def run():
        try:
            await asyncio.to_thread(srv.pool.ensure, served, 0, progress)
            progress({"status": "ready", "model": served.model_id, "bytes": served.memory()})
        except MemoryBudgetError as e:
            progress({"status": "error", "code": "memory_budget", "message": f"out of memory budget: {e}"})
        except UserError as e:  # a broken GGUF, a folder gone: said in the stream, the server goes on
            progress({"status": "error", "code": "model_load_failed", "message": str(e)})
        progress(None)

    task = asyncio.create_task(run())

    async def body():
        start = time.perf_counter()
        while True:
            try:
                event = await asyncio.wait_for(events.get(), BEAT_S)
            except asyncio.TimeoutError:
                event = {"status": "loading", "model": served.model_id, "elapsed_s": round(time.perf_counter() - start, 1)}
            if event is None:
                break
            yield f"data: {json.dumps(event)}\n\n"
        await task

    return StreamingResponse(body(), media_type="text/event-stream", headers={"cache-control": "no-cache"})


@router.post("/justfit/models/{name:path}/unload")
async def unload(name: str, request: Request):
    srv = request.app.state.server
    served = srv.find(name, status=404)
    await wait_idle(served)
    done = await asyncio.to_thread(srv.pool.unload, served)
    return {"model": served.model_id, "unloaded": done}


async def wait_idle(served):
    """Wait for the model's running requests to end; 409 when they do not within BUSY_WAIT_S."""
    deadline = time.monotonic() + BUSY_WAIT_S
    while served.busy:
        if time.monotonic() > deadline:
            raise APIError(409, f"model {served.model_id!r} is still generating; retry the unload later",
                           "model", "model_busy")
        await asyncio.sleep(0.05)
