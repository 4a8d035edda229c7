"""The HTTP shim beside the broker and (``--http-port``) each worker: GET routes for people, probes and
Prometheus, from one hardened server.

Its owner gives it routes, each a function of the query string that reads state replaced atomically by
the owner's loop (the broker's snapshot, a worker's counters); the shim never touches the owner's
sockets. Binds 127.0.0.1 unless told otherwise; another host only when its owner runs CURVE
or was told ``--insecure-network`` (protected mode, ``sockets.check_exposure``).

One thread serves every connection without blocking (a selector), so a peer
that opens many connections or sends a byte at a time costs a descriptor, not a
thread: at most ``MAX_CONNECTIONS`` are open (a new one closes the oldest), and
each has ``REQUEST_DEADLINE_S`` from accept to its response written, however it
trickles. The shim therefore holds at most ``MAX_CONNECTIONS + 1`` descriptors.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Mapping
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from spec_serve.telemetry.logs import event
from spec_serve.transport.sockets import address_family, check_exposure

log = logging.getLogger("spec_serve.http")

Response = tuple[int, str, bytes]  # status code, content type, body
Query = Mapping[str, list[str]]
Route = Callable[[Query], Response]

MAX_REQUEST_LINE = 4096
# A request head (request line and headers) larger than this is refused (431).
MAX_REQUEST_HEAD = 16 << 10
MAX_CONNECTIONS = 32
REQUEST_DEADLINE_S = 5.0


def json_response(code: int, body: Any) -> Response:
    return code, "application/json", json.dumps(body).encode()


def metrics_response(*registries: CollectorRegistry) -> Response:
    """The registries, one after another, in Prometheus' text format (no metric name in two of them)."""
    return 200, CONTENT_TYPE_LATEST, b"".join(generate_latest(registry) for registry in registries)


@dataclasses.dataclass
class _Connection:
    sock: socket.socket
    peer: str
    deadline: float
    received: bytes = b""
    response: memoryview | None = None


class HttpShim:
    """``GET`` on ``routes`` (path -> function of the query); anything else is answered 4xx."""

    def __init__(self, routes: Mapping[str, Route], host: str = "127.0.0.1", port: int = 8080, *,
                 authenticated: bool = False, insecure_network: bool = False):
        """``authenticated``: the owner's ZeroMQ sockets run CURVE (the shim itself is read-only and
        unauthenticated, so it follows them onto the network, or goes there only when told
        ``insecure_network``)."""
        check_exposure(host, f"the HTTP port --http-host {host}", authenticated=authenticated,
                       insecure_network=insecure_network)
        self._routes = dict(routes)
        host = host.strip("[]")  # an IPv6 address, bracketed or not
        self._listener = socket.create_server((host, port), family=address_family(host), backlog=128)
        self._listener.setblocking(False)
        self.host, self.port = self._listener.getsockname()[:2]
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._connections: dict[socket.socket, _Connection] = {}  # oldest first
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="spec-serve-http", daemon=True)

    def start(self) -> HttpShim:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._wake_w.send(b"x")
        self._thread.join(5)
        for conn in list(self._connections.values()):
            self._drop(conn)
        self._selector.close()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()

    # ------------------------------------------------------------- the loop

    def _serve(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=0.5):
                if key.fileobj is self._listener:
                    self._accept()
                    continue
                # the selector holds only sockets (listener, wake-up, connections): a file number never comes
                conn = self._connections.get(key.fileobj) if isinstance(key.fileobj, socket.socket) else None
                if conn is None:  # the wake-up, or a connection dropped earlier in this round
                    continue
                try:
                    self._on_ready(conn)
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError:  # reset by the peer
                    self._drop(conn)
                except Exception as e:  # a peer must never stop the shim
                    log.exception("http.failed error=%s", e)
                    self._drop(conn)
            now = time.monotonic()
            for conn in [c for c in self._connections.values() if c.deadline < now]:
                event(log, logging.DEBUG, "http.deadline", peer=conn.peer)
                self._drop(conn)

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # e.g. the process is out of descriptors: try again shortly
                event(log, logging.WARNING, "http.accept_failed", error=e)
                time.sleep(0.1)
                return
            if len(self._connections) >= MAX_CONNECTIONS:
                self._drop(next(iter(self._connections.values())))  # the oldest: a stalled peer, not a quick one
            sock.setblocking(False)
            conn = _Connection(sock, str(addr[0]), time.monotonic() + REQUEST_DEADLINE_S)
            self._connections[sock] = conn
            self._selector.register(sock, selectors.EVENT_READ)

    def _on_ready(self, conn: _Connection) -> None:
        if conn.response is not None:
            sent = conn.sock.send(conn.response)
            conn.response = conn.response[sent:]
            if not conn.response:
                self._drop(conn)
            return
        data = conn.sock.recv(4096)
        conn.received += data
        end = conn.received.find(b"\r\n\r\n")
        if end < 0 and len(conn.received) > MAX_REQUEST_HEAD:
            self._respond(conn, *_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE))
        elif end >= 0:
            self._respond(conn, *self._route(conn.received[:end]))
        elif not data:  # the peer ended its side before a whole request
            self._respond(conn, *_error(HTTPStatus.BAD_REQUEST))

    def _respond(self, conn: _Connection, code: int, content_type: str, body: bytes) -> None:
        head = (f"HTTP/1.1 {code} {HTTPStatus(code).phrase}\r\nServer: spec-serve\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        conn.response = memoryview(head + body)
        event(log, logging.DEBUG, "http.request", peer=conn.peer, code=code)
        self._selector.modify(conn.sock, selectors.EVENT_WRITE)

    def _drop(self, conn: _Connection) -> None:
        self._connections.pop(conn.sock, None)
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    # ------------------------------------------------------------- routes

    def _route(self, head: bytes) -> Response:
        line = head.split(b"\r\n", 1)[0]
        parts = line.split(b" ")
        if len(parts) != 3:
            return _error(HTTPStatus.BAD_REQUEST)
        method, target, version = parts
        if version not in (b"HTTP/1.0", b"HTTP/1.1"):
            return _error(HTTPStatus.HTTP_VERSION_NOT_SUPPORTED)
        if method != b"GET":
            return _error(HTTPStatus.METHOD_NOT_ALLOWED, "only GET is served")
        if len(target) > MAX_REQUEST_LINE:
            return _error(HTTPStatus.REQUEST_URI_TOO_LONG)
        return self._handle(target.decode("latin-1"))

    def _handle(self, path: str) -> Response:
        url = urlsplit(path)
        route = self._routes.get(url.path)
        if route is None:
            return json_response(404, {"error": f"no route {url.path}", "routes": sorted(self._routes)})
        return route(parse_qs(url.query))


def _error(status: HTTPStatus, message: str | None = None) -> Response:
    return json_response(status.value, {"error": message or status.phrase})
