"""Connection limits for `justfit serve`: header and body read timeouts and connection caps per client
address and overall, so that clients that open sockets and never finish a request (slowloris) cannot
use up the server's file descriptors or keep an authorized request waiting.

uvicorn's h11 protocol has a keep-alive timeout between requests but none while a request's headers
or body arrive, and no connection cap (`limit_concurrency` answers 503 only once a request is
complete). `Guarded` is that protocol with a deadline per request phase and admission through a
`Gate` shared by every connection of the server. A client at its cap, or a server at its total, makes
room by closing its oldest connection still waiting for request headers (a new connection is far more
likely to be a real client than the oldest idle one); when every connection has a request in flight,
the new one is answered 503 and closed.
"""

import json
import logging
import resource
from typing import Dict, Optional, Tuple

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("justfit.server")
FD_RESERVE = 128  # descriptors kept free of client sockets: model files, sessions, logs, pipes


def _raw(status: int, reason: str, message: str, code: str, extra: str = "") -> bytes:
    """A whole HTTP/1.1 response in OpenAI's error envelope, for a connection that has no request
    cycle (uvicorn's h11 state cannot send a response before it has read a request)."""
    body = json.dumps({"error": {"message": message, "type": "timeout_error" if status == 408 else "overloaded_error",
                                 "param": None, "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n{extra}\r\n")
    return head.encode() + body


class Gate:
    """Limits and bookkeeping shared by every connection of one server."""

    def __init__(self, header_timeout: float = 10.0, body_timeout: float = 60.0, max_connections: int = 1000,
                 max_per_client: int = 256):
        self.header_timeout, self.body_timeout = header_timeout, body_timeout
        (self.max_connections, self.backlog), self.max_per_client = fd_budget(max_connections), max_per_client
        self.clients: Dict[str, Dict["Guarded", None]] = {}  # address -> its connections, oldest first
        self.waiting: Dict["Guarded", None] = {}  # connections waiting for request headers, oldest first
        self.open = 0
        self.closed = {"header_timeout": 0, "body_timeout": 0, "evicted": 0, "refused": 0}

    def admit(self, conn: "Guarded") -> bool:
        """Register a new connection, evicting an idle one to make room; False: refuse it."""
        mine = self.clients.setdefault(conn.address, {})
        if len(mine) >= self.max_per_client and not self._evict(next((c for c in mine if c in self.waiting), None)):
            return False
        if self.open >= self.max_connections and not self._evict(next(iter(self.waiting), None)):
            return False
        mine[conn] = None
        self.open += 1
        return True

    def _evict(self, victim: Optional["Guarded"]) -> bool:
        if victim is None:
            return False
        victim.close_now("evicted", None)
        return True

    def wait(self, conn: "Guarded", waiting: bool):
        """Mark a connection as waiting for request headers (evictable) or not; a connection that
        waits again after a response goes to the end of the line."""
        if waiting and conn not in self.waiting:
            self.waiting[conn] = None
        elif not waiting:
            self.waiting.pop(conn, None)

    def leave(self, conn: "Guarded"):
        mine = self.clients.get(conn.address)
        if mine is not None and conn in mine:
            del mine[conn]
            self.open -= 1
            if not mine:
                del self.clients[conn.address]
        self.waiting.pop(conn, None)

    def count(self, reason: str):
        self.closed[reason] = self.closed.get(reason, 0) + 1

    def metric_lines(self) -> list:
        """Prometheus lines: open connections and the ones closed by a limit, by reason."""
        return ["# HELP justfit_connections_open Client connections open now.", "# TYPE justfit_connections_open gauge",
                f"justfit_connections_open {self.open}",
                "# HELP justfit_connections_closed_total Connections closed or refused by a limit, by reason.",
                "# TYPE justfit_connections_closed_total counter"] + \
               [f'justfit_connections_closed_total{{reason="{r}"}} {n}' for r, n in sorted(self.closed.items())]


def fd_budget(max_connections: int) -> Tuple[int, int]:
    """(connection cap, listen backlog) that fit the process's open-file limit: asyncio accepts up
    to `backlog` sockets in one burst before any of them reaches the Gate, and a second burst can come
    before the connections the first one evicted have closed (a transport closes its socket on the
    loop's next turn), so the cap, two bursts and FD_RESERVE must fit under the limit together."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return max_connections, 2048
    backlog = min(2048, max(16, (soft - FD_RESERVE) // 6))
    room = max(16, soft - FD_RESERVE - 2 * backlog)
    if room < max_connections:
        log.warning("connection cap lowered from %d to %d: the open-file limit is %d (ulimit -n)",
                    max_connections, room, soft)
    return min(max_connections, room), backlog


class Guarded(H11Protocol):
    """uvicorn's h11 protocol under a Gate: admission on connect, a header deadline while a request's
    headers are awaited, a body deadline while its body is awaited, none while the app answers."""

    gate: Gate  # set on the subclass `protocol_for` makes

    def connection_made(self, transport):
        super().connection_made(transport)
        self.address = self.client[0] if self.client else ""
        self.timer, self.phase, self.gone = None, None, False
        if not self.gate.admit(self):
            self.gone = True
            self.gate.count("refused")
            log.warning("refused a connection from %s: every connection slot has a request in flight", self.address)
            transport.write(_raw(503, "Service Unavailable", "too many connections: retry shortly", "too_many_connections",
                                 "retry-after: 1\r\n"))
            transport.close()
            return
        self._follow()

    def data_received(self, data: bytes):
        super().data_received(data)
        self._follow()

    def on_response_complete(self):
        super().on_response_complete()
        self._follow()

    def connection_lost(self, exc):
        self._disarm()
        if not self.gone:
            self.gone = True
            self.gate.leave(self)
        super().connection_lost(exc)

    def _follow(self):
        """Arm the deadline of the phase the client's side of the connection is in."""
        if self.gone or self.transport.is_closing():
            return
        state = self.conn.their_state
        phase = "header" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
        self.gate.wait(self, phase == "header")
        if phase == self.phase:
            return  # a deadline runs from the phase's start, not from the last byte
        self._disarm()
        self.phase = phase
        if phase is not None:
            seconds = self.gate.header_timeout if phase == "header" else self.gate.body_timeout
            self.timer = self.loop.call_later(seconds, self.close_now, f"{phase}_timeout", seconds)

    def _disarm(self):
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def close_now(self, reason: str, seconds: Optional[float]):
        """Close this connection (a deadline passed, or a newer connection needs its slot)."""
        if self.gone:
            return
        self._disarm()
        self.gone = True
        self.gate.leave(self)
        self.gate.count(reason)
        if seconds is not None:
            log.warning("closed a connection from %s: the request %s did not arrive within %g s", self.address,
                        "headers" if reason == "header_timeout" else "body", seconds)
            if self.cycle is None or not self.cycle.response_started:
                self.transport.write(_raw(408, "Request Timeout", f"request not received within {seconds:g} s",
                                          "request_timeout"))
        else:
            log.warning("closed the oldest connection from %s still waiting for request headers, to make room "
                        "for a new one", self.address)
        self.transport.close()  # uvicorn's connection_lost then tells a waiting app http.disconnect


def protocol_for(gate: Gate) -> type:
    """The protocol class uvicorn instantiates per connection, bound to `gate`."""
    return type("GuardedH11Protocol", (Guarded,), {"gate": gate})
