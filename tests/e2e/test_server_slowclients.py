"""Slow and idle clients against a real `justfit serve` on loopback: 2,100 half-sent requests from
several addresses neither use up the server's file descriptors nor keep an authorized request waiting,
a request whose headers or body stop coming is closed after its deadline, and the log stays small.
Also the log rate limit, without a server."""

import logging
import os
import resource
import socket
import sys
import time

import httpx
import pytest

from justfit.server.logs import RateLimit

from tests.server_support import Served

KEY = "sk-slow-123"
AUTH = {"authorization": f"Bearer {KEY}"}
HALF = b"GET /health HTTP/1.1\r\nHost: x\r\n"  # the blank line that ends the headers never comes
MAX_CONNECTIONS, MAX_CLIENT = 1000, 256  # the defaults of --max-connections and --max-client-connections
HEADER_S, BODY_S = 3, 3
FD_LIMIT = 2048  # the server's descriptor limit (mlx_lm sets this soft limit on import): below the attack's
ATTACK = 2100  # sockets

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts descriptors in /proc (Linux)")


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    """A server with its default connection caps, started under a 2,048-file limit (inherited from this
    process, which then takes its own limit back for the attack's sockets)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(FD_LIMIT, soft), hard))
    try:
        s = Served(tmp_path_factory.mktemp("serve-slow"), str(default_model_dir), "--api-key", KEY,
                   "--header-timeout", str(HEADER_S), "--body-timeout", str(BODY_S))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    yield s
    s.stop()


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def half_open(n: int, sources) -> list:
    """n sockets that each send a request line and one header, then nothing (this process's file limit is
    raised to hold them beside the ones it has open: earlier waves' sockets included)."""
    need = fds(os.getpid()) + n + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"this process may open {hard} files; the attack needs {need}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    return [s for s in (_one(sources[i % len(sources)]) for i in range(n)) if s is not None]


def _one(source: str):
    s = socket.socket()
    s.settimeout(2)
    try:
        s.bind((source, 0))
        s.connect(_one.target)
        s.sendall(HALF)
        return s
    except OSError:  # refused, reset or timed out: the server is shedding; keep going
        s.close()
        return None


def sources() -> list:
    """Loopback source addresses this host lets a client bind (all of 127/8 on Linux)."""
    out = []
    for i in range(2, 8):
        with socket.socket() as s:
            try:
                s.bind((f"127.0.0.{i}", 0))
                out.append(f"127.0.0.{i}")
            except OSError:
                pass
    return out or ["127.0.0.1"]


def timed_request(url: str) -> float:
    start = time.perf_counter()
    r = httpx.get(url + "/v1/models", headers=AUTH, timeout=15)
    assert r.status_code == 200, r.text
    return time.perf_counter() - start


def test_half_sent_requests_do_not_starve_an_authorized_one(server):
    pid, port = server.proc.pid, server.port
    _one.target = ("127.0.0.1", port)
    quiet = [timed_request(server.url) for _ in range(3)]
    base_fds, base_log = fds(pid), server.log_path.stat().st_size
    socks, peak = [], base_fds
    try:
        addrs = sources()
        for _ in range(3):  # in 3 waves, looking at the server's descriptors between them
            socks += half_open(ATTACK // 3, addrs)
            peak = max(peak, fds(pid))
        under_attack = sorted(timed_request(server.url) for _ in range(3))
        time.sleep(0.2)  # let a burst of accepted sockets reach the Gate
        settled = fds(pid)
        print(f"\nauthorized GET /v1/models: quiet {min(quiet) * 1e3:.0f} ms, after {ATTACK} half-sent "
              f"connections {under_attack[0] * 1e3:.0f}/{under_attack[1] * 1e3:.0f}/{under_attack[2] * 1e3:.0f} ms; "
              f"server fds {base_fds} -> peak {peak}, settled {settled}; "
              f"log +{server.log_path.stat().st_size - base_log} bytes")
        assert under_attack[1] < 1.0, under_attack  # a few hundred ms on an idle machine
        assert peak < FD_LIMIT and settled <= base_fds + MAX_CONNECTIONS + 16
    finally:
        for s in socks:
            s.close()
    assert server.log_path.stat().st_size - base_log < 32_000  # rate-limited warnings, no tracebacks
    assert "Too many open files" not in server.text() and "Traceback" not in server.text()
    metrics = httpx.get(server.url + "/metrics", headers=AUTH).text
    assert 'justfit_connections_closed_total{reason="evicted"}' in metrics


def _closed_within(sock: socket.socket, seconds: float) -> bytes:
    """What the server sent before closing `sock`; fails if it is still open after `seconds`."""
    sock.settimeout(seconds)
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except socket.timeout:
        pytest.fail(f"the connection is still open after {seconds} s; got {got!r}")
    except ConnectionResetError:
        pass
    return got


def test_unfinished_headers_are_closed_after_the_header_timeout(server):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(HALF)
        start = time.monotonic()
        got = _closed_within(s, HEADER_S + 5)
        assert HEADER_S - 0.5 <= time.monotonic() - start and got.startswith(b"HTTP/1.1 408"), got


def test_unfinished_body_is_closed_after_the_body_timeout(server):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                  b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\": ")
        start = time.monotonic()
        got = _closed_within(s, BODY_S + 5)
        assert BODY_S - 0.5 <= time.monotonic() - start and got.startswith(b"HTTP/1.1 408"), got
    assert httpx.get(server.url + "/health").status_code == 200
    assert "POST /v1/chat/completions 408" in server.text()  # logged as the timeout it was


def test_a_client_at_its_cap_still_gets_its_new_request_served(server):
    """One address: idle connections past its cap close its oldest idle one, so the server holds at
    most the cap for it and the new request runs."""
    _one.target = ("127.0.0.1", server.port)
    base = fds(server.proc.pid)
    socks = [s for s in (_one("127.0.0.1") for _ in range(MAX_CLIENT + 100)) if s is not None]
    try:
        assert timed_request(server.url) < 1.0
        time.sleep(0.2)
        assert fds(server.proc.pid) <= base + MAX_CLIENT + 8
    finally:
        for s in socks:
            s.close()


def test_log_rate_limit_counts_what_it_drops():
    now = [0.0]
    limit = RateLimit(per_second=3, clock=lambda: now[0])
    rec = lambda msg="accept failed: %s": logging.LogRecord("x", logging.ERROR, __file__, 1, msg, ("EMFILE",), None)  # noqa: E731
    passed = [limit.filter(rec()) for _ in range(1000)]
    assert sum(passed) == 3
    assert limit.filter(rec("another error"))  # another template has its own budget
    assert limit.filter(logging.LogRecord("x", logging.INFO, __file__, 1, "accept failed: %s", ("x",), None))
    now[0] = 1.5
    r = rec()
    assert limit.filter(r) and "997 similar lines suppressed" in r.getMessage()
