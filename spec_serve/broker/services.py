"""Services and their queues: requests wait here per service and per client until dispatch takes them.

A service is a name workers register under and clients send to. Its queue is fair across clients
(``next_request`` takes them in round-robin order); which worker takes a request is dispatch.py's call.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import TypeVar

from spec_serve.broker.context import BrokerContext
from spec_serve.broker.state import Request, RequestTable, ServiceState
from spec_serve.protocol.commands import UNKNOWN_SERVICE_GRACE, ErrorCode

# Service names that ever had a worker, remembered after the service is forgotten (see unknown).
MAX_SERVED_NAMES = 4096
# The DONE statuses the completed metric counts by (DoneStatus values); engine_dead counts as an error, and
# a returned request is not completed.
DONE_STATUSES = ("ok", "error", "undeliverable")

T = TypeVar("T")


class ServiceQueues:
    """Services by name, the names that ever had workers, and the per-client queues of each service."""

    def __init__(self, ctx: BrokerContext, requests: RequestTable):
        self.ctx = ctx
        self.requests = requests
        self.services: dict[str, ServiceState] = {}
        self.served: collections.OrderedDict[str, None] = collections.OrderedDict()  # names that had workers

    def get(self, name: str) -> ServiceState | None:
        return self.services.get(name)

    def __getitem__(self, name: str) -> ServiceState:
        return self.services[name]

    def __iter__(self) -> Iterator[ServiceState]:
        return iter(list(self.services.values()))

    def service(self, name: str, now: float) -> ServiceState:
        """The service ``name``, created now if it is new. The one place a service comes into being, for an
        admitted peer only: a worker whose READY passed the registry's checks, or a client whose REQUEST or
        SET_VOCAB was admitted (clients.py). A peer the sockets do not admit (CURVE, protected mode) never
        gets here; an admission rule on names belongs here."""
        service = self.services.get(name)
        if service is None:
            service = self.services[name] = ServiceState(name, now)
        return service

    def remember_served(self, name: str) -> None:
        self.served[name] = None
        self.served.move_to_end(name)
        while len(self.served) > MAX_SERVED_NAMES:
            self.served.popitem(last=False)

    # ------------------------------------------------------------------ queues

    def push(self, request: Request, front: bool = False) -> None:
        """Queue ``request`` under its service and client; ``front``: it goes next (it was taken from a worker)."""
        queue = self.services[request.service].queues.setdefault(request.client, collections.deque())
        if front:
            queue.appendleft(request.request_id)
        else:
            queue.append(request.request_id)

    def drop_client(self, identity: bytes) -> None:
        """Forget the queues of a client that left (its requests are dropped from the table by the caller)."""
        for service in self.services.values():
            service.queues.pop(identity, None)

    def next_request(self, service: ServiceState, accept: Callable[[Request], T | None]) -> tuple[Request, T] | None:
        """The first queued request (clients in round-robin order) that ``accept`` takes (a non-empty answer),
        off its queue, with that answer; None if it takes none. Ids of forgotten requests are dropped."""
        for client_id, queue in list(service.queues.items()):
            for request_id in list(queue):
                request = self.requests.get(request_id)
                if request is None:  # forgotten meanwhile (its client left, or it timed out)
                    queue.remove(request_id)
                    continue
                answer = accept(request)
                if not answer:
                    continue
                queue.remove(request_id)
                if queue:
                    service.queues.move_to_end(client_id)
                else:
                    del service.queues[client_id]
                return request, answer
            if not queue:
                del service.queues[client_id]
        return None

    def expire(self, service: ServiceState, now: float, forget: Callable[[Request], None]) -> None:
        """Fail the queued requests of ``service`` past their deadline, or all of them once the service is
        unknown (no worker ever served it); ``forget`` drops each from the broker's tables."""
        unknown = self.unknown(service.name, now)
        for client_id, queue in list(service.queues.items()):
            for request_id in list(queue):
                request = self.requests.get(request_id)
                if request is None:
                    queue.remove(request_id)
                    continue
                if not (unknown or request.deadline < now):
                    continue
                queue.remove(request_id)
                forget(request)
                if unknown:
                    self.ctx.send_error(client_id, request_id, ErrorCode.UNKNOWN_SERVICE,
                                        self.unknown_message(service.name))
                else:
                    self.ctx.send_error(client_id, request_id, ErrorCode.TIMEOUT,
                                        f"no worker of {service.name!r} took the request before its deadline")
            if not queue:
                service.queues.pop(client_id, None)

    # ------------------------------------------------------------------ names

    def unknown(self, name: str, now: float) -> bool:
        """No worker ever served it, and the grace since its first use (workers still loading) is over."""
        service = self.services.get(name)
        return name not in self.served and service is not None and now - service.created_at > UNKNOWN_SERVICE_GRACE

    def unknown_message(self, name: str) -> str:
        known = sorted(s for s, st in self.services.items() if st.workers)
        return f"unknown service {name!r}: no worker serves it; services with workers: {known}"

    def forget_unused(self, in_use: set[str]) -> None:
        """Drop each service with no worker and no queue that nobody uses (``in_use``: named by a connected
        client's requests or mappings, or by a request the broker holds), so a name a peer once used does not
        linger: not for readiness, not in STATUS, not in the metrics. ``served`` still remembers those that
        had workers (their requests wait for workers that restart)."""
        for name, service in list(self.services.items()):
            if not (service.workers or service.queues or name in in_use):
                del self.services[name]
                self.ctx.metrics.forget_service(name, DONE_STATUSES)
                self.ctx.status_stale = True

    def update_metrics(self) -> None:
        for service in self.services.values():
            self.ctx.metrics.queue_depth.labels(service=service.name).set(service.queue_depth())
