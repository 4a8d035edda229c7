"""A small HTTP shim beside the broker: health, model info, workers, metrics.

It reads the broker's snapshot (replaced atomically by the broker loop) and
never touches the broker's sockets. Binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from spec_serve.logs import event

log = logging.getLogger("spec_serve.http")

MAX_REQUEST_LINE = 4096


def health(snapshot: dict[str, Any]) -> tuple[int, dict]:
    """200 when every served service has a ready worker (and one exists), else 503.

    A service counts once a worker has registered for it: a name only clients asked for (a typo,
    or junk) must not turn the health check red.
    """
    services = snapshot.get("services", {})
    counts = {name: s["ready_workers"] for name, s in services.items() if s["ever_had_workers"]}
    healthy = bool(counts) and all(n > 0 for n in counts.values())
    body = {"status": "ok" if healthy else "unavailable", "workers": len(snapshot.get("workers", [])),
            "ready_workers": counts}
    return (200 if healthy else 503), body


def model_info(snapshot: dict[str, Any], service: str | None) -> tuple[int, dict]:
    """Target info per service (of its first worker), or of one ``service``."""
    infos: dict[str, Any] = {}
    for w in snapshot.get("workers", []):
        infos.setdefault(w["service"], w["target_info"])
    if service is not None:
        if service not in infos:
            return 404, {"error": f"no worker serves {service!r}", "services": sorted(infos)}
        return 200, infos[service]
    return 200, infos


class HttpShim:
    """``GET /health``, ``/model_info[?service=]``, ``/workers``, ``/metrics``."""

    def __init__(self, snapshot: Callable[[], dict], registry, host: str = "127.0.0.1", port: int = 8080,
                 refresh: Callable[[], None] | None = None):
        shim = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "spec-serve"
            timeout = 10  # a peer that stalls mid-request loses its thread after this (no slowloris)

            def log_message(self, fmt, *args):  # quiet: structured log at DEBUG instead
                event(log, logging.DEBUG, "http.request", peer=self.client_address[0], line=fmt % args)

            def do_GET(self):
                shim._handle(self)

            def _refuse(self):
                self.send_error(HTTPStatus.METHOD_NOT_ALLOWED, "only GET is served")

            do_POST = do_PUT = do_DELETE = do_PATCH = _refuse

        self._snapshot = snapshot
        self._registry = registry
        self._refresh = refresh
        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.host, self.port = self.server.server_address[:2]
        self._thread = threading.Thread(target=self.server.serve_forever, name="spec-serve-http", daemon=True)

    def start(self) -> "HttpShim":
        self._thread.start()
        return self

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        if len(h.path) > MAX_REQUEST_LINE:
            h.send_error(HTTPStatus.REQUEST_URI_TOO_LONG)
            return
        url = urlsplit(h.path)
        query = parse_qs(url.query)
        snap = self._snapshot()
        if url.path == "/health":
            code, body = health(snap)
        elif url.path == "/model_info":
            code, body = model_info(snap, query.get("service", [None])[0])
        elif url.path == "/workers":
            code, body = 200, {"workers": snap.get("workers", []), "services": snap.get("services", {})}
        elif url.path == "/metrics":
            if self._refresh is not None:
                self._refresh()
            data = generate_latest(self._registry)
            h.send_response(200)
            h.send_header("Content-Type", CONTENT_TYPE_LATEST)
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            h.wfile.write(data)
            return
        else:
            code, body = 404, {"error": f"no route {url.path}", "routes": ["/health", "/model_info", "/workers",
                                                                           "/metrics"]}
        data = json.dumps(body).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)
