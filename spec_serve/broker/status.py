"""What the broker reports about itself: the full status (the HTTP shim's snapshot), the paged STATUS
replies clients ask for, and the routes of its HTTP shim. Reads the router's state, changes nothing."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry

from spec_serve.broker.routing import Router
from spec_serve.broker.state import ServiceState, WorkerState
from spec_serve.protocol.commands import MAX_HEADER_BYTES, UNKNOWN_SERVICE_GRACE, encode_header
from spec_serve.protocol.messages import StatusPage, StatusQuery
from spec_serve.transport.http_shim import Query, Response, Route, json_response, metrics_response

# Entries one STATUS page carries, in encoded bytes: a page stays far below the peers' header limit.
STATUS_PAGE_BYTES = MAX_HEADER_BYTES // 2


def full_status(router: Router) -> dict[str, Any]:
    """Workers, services and queues, all of them: the HTTP shim's snapshot."""
    now = time.monotonic()
    in_use = router.in_use()
    return dict(_summary(router),
                services={name: _service_entry(router, s, in_use) for name, s in router.services.items()},
                workers=[_worker_entry(router, w, now) for w in router.workers.values()])


def status_page(router: Router, query: StatusQuery) -> StatusPage:
    """One STATUS reply: the summary, then services and workers in a stable order, as many as fit
    STATUS_PAGE_BYTES, after the cursor ``query.after``; ``next`` is the cursor of the next page
    (None on the last). ``query.service`` limits it to one service and its workers."""
    only, after = query.service, tuple(query.after) if query.after is not None else None
    services, workers, used, last, more = {}, [], 0, None, False
    for key, entry in _entries(router, only, time.monotonic()):
        if after is not None and key <= after:
            continue
        size = len(encode_header(entry)) + 64  # + the service name and separators
        if used + size > STATUS_PAGE_BYTES and last is not None:
            more = True
            break
        if key[0] == 0:
            services[key[1]] = entry
        else:
            workers.append(entry)
        used, last = used + size, key
    # ``more`` is set only once a page holds an entry, so ``last`` is then a key
    cursor = list(last) if more and last is not None else None
    return StatusPage(**_summary(router), services=services, workers=workers, next=cursor)


def _entries(router: Router, only: str | None, now: float) -> Iterator[tuple[tuple, dict[str, Any]]]:
    """``((0, name), service entry)`` for every service, then ``((1, service, identity), worker entry)``
    for every worker, each in sorted order (a page's cursor is the last key it holds)."""
    if only is None:
        names, chosen = sorted(router.services), list(router.workers.values())
    elif only in router.services:
        names, chosen = [only], [router.workers[i] for i in router.services[only].workers]
    else:
        names, chosen = [], []
    in_use = router.in_use() if names else set()
    for name in names:
        yield (0, name), _service_entry(router, router.services[name], in_use)
    for worker in sorted(chosen, key=lambda w: (w.service, w.identity.hex())):
        yield (1, worker.service, worker.identity.hex()), _worker_entry(router, worker, now)


def _summary(router: Router) -> dict[str, Any]:
    return {
        "broker": router.instance_id,
        "uptime_s": round(time.time() - router.started_at, 3),
        "unknown_service_grace_s": UNKNOWN_SERVICE_GRACE,
        "clients": len(router.clients),
        "inflight": sum(1 for r in router.requests.values() if r.worker is not None),
        "queued": sum(s.queue_depth() for s in router.services.values()),
        "service_count": len(router.services),
        "worker_count": len(router.workers),
        "max_message_bytes": router.max_message_bytes,  # the largest request this broker accepts
    }


def _service_entry(router: Router, service: ServiceState, in_use: set[str]) -> dict[str, Any]:
    """``ready_workers``: those that take pool requests (not bound, not leaving); ``in_use``: a connected client
    named the service, or the broker holds a request for it (readiness counts only such services)."""
    workers = [router.workers[w] for w in service.workers]
    return {
        "workers": len(workers),
        "ready_workers": sum(1 for w in workers if w.bound_to is None and not w.leaving),
        "queue_depth": service.queue_depth(),
        "vocab_mappings": len(service.mappings),
        "ever_had_workers": service.name in router.served,
        "in_use": service.name in in_use,
        "sizing": router.supply.services.get(service.name),  # supply, demand, advice (None before a tick)
    }


def _worker_entry(router: Router, w: WorkerState, now: float) -> dict[str, Any]:
    return {
        "id": w.name,
        "service": w.service,
        "state": "leaving" if w.leaving else "bound" if w.bound_to else ("busy" if w.inflight else "idle"),
        "bound_to": w.bound_to.hex()[:12] if w.bound_to else None,
        "inflight": len(w.inflight),
        "capacity": w.capacity,
        "completed": w.completed,
        **router.supply.workers.get(w.identity, {"busy": None, "supply_tps": None}),
        "last_seen_s": round(max(0.0, router.expiry_window - (w.expiry - now)), 3),
        "registered_at": w.registered_at,
        "max_message_bytes": w.max_message_bytes,
        "target_info": w.info,
    }


class Snapshot:
    """The broker's status for other threads (the HTTP shim): the latest ``full_status``, replaced whole by
    the loop once per turn it changed, and when the loop last turned, so that /health can tell a stalled
    or stopped loop from a running one."""

    def __init__(self, stall_s: float):
        self.stall_s = stall_s
        self._status: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._turned_at: float | None = None  # monotonic; None before the loop runs and once it stopped

    def turned(self, now: float | None) -> None:
        """The loop turns (at ``now``), or stopped (None)."""
        self._turned_at = now

    def update(self, router: Router) -> dict[str, Any]:
        """Rebuild the status from ``router`` (the loop's thread only); the new status."""
        status = full_status(router)
        with self._lock:
            self._status = status
        return status

    def read(self) -> dict[str, Any]:
        """The latest status with ``loop``: ``age_s`` since the loop last turned (None: not running) and
        ``stall_s``, past which it counts as stalled. Safe from any thread."""
        with self._lock:
            status = self._status
        turned_at = self._turned_at
        age = None if turned_at is None else round(time.monotonic() - turned_at, 3)
        return dict(status, loop={"age_s": age, "stall_s": self.stall_s})


# ------------------------------------------------------------------ the broker's HTTP routes


def health(snapshot: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Liveness: 200 while the broker's loop turns (it last turned within ``loop.stall_s``), else 503. It says
    nothing about workers: a broker waiting for its first worker is alive (readiness is ``ready``)."""
    loop = snapshot.get("loop") or {}
    age = loop.get("age_s")
    alive = age is not None and age <= loop.get("stall_s", 0)
    status = "ok" if alive else ("stopped" if age is None else "stalled")
    return (200 if alive else 503), {"status": status, "loop_age_s": age, "workers": len(snapshot.get("workers", []))}


def ready(snapshot: dict[str, Any], service: str | None = None) -> tuple[int, dict[str, Any]]:
    """Readiness: 200 when the broker is alive and can serve, else 503.

    For one ``service``: it has a worker that takes pool requests (not bound, not leaving). For the broker:
    some worker is ready, and every service clients use (a connected client named it, or a request for it is
    held) that has had workers has a ready one now. A service nobody uses, such as one a stray READY made,
    does not count: it cannot turn readiness red, and it is forgotten once its workers are gone.
    """
    alive, _ = health(snapshot)
    services = snapshot.get("services", {})
    if service is not None:
        entry = services.get(service)
        count = entry["ready_workers"] if entry is not None else 0
        ok = alive == 200 and count > 0
        body = {"status": "ok" if ok else "unavailable", "service": service, "ready_workers": count}
        if entry is None:
            body["error"] = f"no worker serves {service!r}"
        return (200 if ok else 503), body
    counted = {name: s["ready_workers"] for name, s in services.items() if s["in_use"] and s["ever_had_workers"]}
    missing = sorted(name for name, n in counted.items() if n == 0)
    ok = alive == 200 and any(s["ready_workers"] > 0 for s in services.values()) and not missing
    body = {"status": "ok" if ok else "unavailable", "workers": len(snapshot.get("workers", [])),
            "ready_workers": {name: s["ready_workers"] for name, s in services.items()
                              if s["workers"] or name in counted},
            "services_without_ready_workers": missing}
    return (200 if ok else 503), body


def model_info(snapshot: dict[str, Any], service: str | None) -> tuple[int, Any]:
    """Target info per service (of its first worker), or of one ``service``."""
    infos: dict[str, Any] = {}
    for w in snapshot.get("workers", []):
        infos.setdefault(w["service"], w["target_info"])
    if service is not None:
        if service not in infos:
            return 404, {"error": f"no worker serves {service!r}", "services": sorted(infos)}
        return 200, infos[service]
    return 200, infos


def http_routes(snapshot: Callable[[], dict[str, Any]], registry: CollectorRegistry) -> dict[str, Route]:
    """The broker's HTTP shim: ``/health`` (liveness; ``?service=NAME``: that service's readiness),
    ``/ready[?service=NAME]``, ``/model_info[?service=]``, ``/workers``, ``/metrics``, each read from
    ``snapshot`` (replaced atomically by the broker loop) or the metrics ``registry``."""
    def workers(query: Query) -> Response:
        snap = snapshot()
        return json_response(200, {"workers": snap.get("workers", []), "services": snap.get("services", {})})

    def alive(query: Query) -> Response:
        service = query.get("service", [None])[0]
        return json_response(*(health(snapshot()) if service is None else ready(snapshot(), service)))

    return {
        "/health": alive,
        "/ready": lambda query: json_response(*ready(snapshot(), query.get("service", [None])[0])),
        "/model_info": lambda query: json_response(*model_info(snapshot(), query.get("service", [None])[0])),
        "/workers": workers,
        "/metrics": lambda query: metrics_response(registry),
    }
