"""What the broker reports about itself: the full status (the HTTP shim's snapshot) and the paged
STATUS replies clients ask for. Reads the router's state, changes nothing."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from spec_serve.broker.routing import Router
from spec_serve.broker.state import ServiceState, WorkerState
from spec_serve.protocol.commands import MAX_HEADER_BYTES, UNKNOWN_SERVICE_GRACE, encode_header
from spec_serve.protocol.messages import StatusPage, StatusQuery

# Entries one STATUS page carries, in encoded bytes: a page stays far below the peers' header limit.
STATUS_PAGE_BYTES = MAX_HEADER_BYTES // 2


def full_status(router: Router) -> dict[str, Any]:
    """Workers, services and queues, all of them: the HTTP shim's snapshot."""
    now = time.monotonic()
    return dict(_summary(router),
                services={name: _service_entry(router, s) for name, s in router.services.items()},
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
    for name in names:
        yield (0, name), _service_entry(router, router.services[name])
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


def _service_entry(router: Router, service: ServiceState) -> dict[str, Any]:
    return {
        "workers": len(service.workers),
        "ready_workers": sum(1 for w in service.workers if router.workers[w].bound_to is None
                             and not router.workers[w].leaving),
        "queue_depth": service.queue_depth(),
        "vocab_mappings": len(service.mappings),
        "ever_had_workers": service.name in router.served,
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
        "last_seen_s": round(max(0.0, router.expiry_window - (w.expiry - now)), 3),
        "registered_at": w.registered_at,
        "max_message_bytes": w.max_message_bytes,
        "target_info": w.info,
    }

