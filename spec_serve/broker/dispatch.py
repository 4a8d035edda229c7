"""Dispatch and re-dispatch: which worker takes a queued request, and what becomes of a request whose
worker answered, died, or held it past its deadline.

Dispatch is fair across clients (the service's queue hands them out in round-robin order) and gives each
request the first free worker of its ranking (ranking.py: isolation, anti-affinity, affinity, locality,
load). A request that was on a worker as it died is a *suspect*: it runs alone, and after
``max_request_deaths`` such deaths it fails (``killed_workers``) instead of going to another worker.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time
from collections.abc import Callable

from spec_serve.broker import ranking
from spec_serve.broker.clients import ClientTable
from spec_serve.broker.context import BrokerContext
from spec_serve.broker.poison import PoisonPolicy
from spec_serve.broker.services import DONE_STATUSES, ServiceQueues
from spec_serve.broker.state import ClientState, Request, RequestTable, ServiceState, WorkerState
from spec_serve.broker.supply import SupplyDemand
from spec_serve.broker.vocab_registry import VocabRegistry
from spec_serve.broker.workers import WorkerRegistry
from spec_serve.protocol.commands import WORKER_TAG, DoneStatus, ErrorCode, Message, WorkerCommand, control
from spec_serve.protocol.messages import Done, SupervisionRequest
from spec_serve.telemetry.logs import event

log = logging.getLogger("spec_serve.broker")

# Dispatched requests whose client left before their worker's DONE came, kept so that DONE is still
# counted: a client may close as soon as it holds its reply, which then races the worker's DONE. A
# request whose DONE never comes (its worker died) stays until this many newer ones pushed it out.
MAX_DETACHED_IDS = 1024


class Dispatcher:
    """Requests from their queues to workers and back; single-threaded (the broker loop calls it).

    ``unreachable(worker)`` is called when a send to ``worker`` fails: the caller removes it (its requests
    come back here through ``orphan``)."""

    def __init__(self, ctx: BrokerContext, services: ServiceQueues, workers: WorkerRegistry, clients: ClientTable,
                 requests: RequestTable, vocab: VocabRegistry, supply: SupplyDemand, *, max_request_deaths: int,
                 unreachable: Callable[[WorkerState], None]):
        self.ctx = ctx
        self.services = services
        self.workers = workers
        self.clients = clients
        self.requests = requests
        self.vocab = vocab
        self.supply = supply
        self.poison = PoisonPolicy(ctx, max_request_deaths)
        self.unreachable = unreachable
        # request id -> (its worker, when it was enqueued): see MAX_DETACHED_IDS
        self.detached: collections.OrderedDict[bytes, tuple[bytes, float]] = collections.OrderedDict()

    # ------------------------------------------------------------------ intake

    def seen_before(self, client: ClientState, msg: Message, header: SupervisionRequest, now: float) -> bool:
        """True if the REQUEST is one the broker already settled: a retry of a request it failed for killing
        workers (refused again), or of one it still holds (kept once, its deadline extended)."""
        killed = self.poison.refusal(msg.request_id)
        if killed is not None:  # a retry that crossed its killed_workers error
            self.ctx.send_error(client.identity, msg.request_id, ErrorCode.KILLED_WORKERS, killed)
            return True
        existing = self.requests.get(msg.request_id)
        if existing is None:
            return False
        # A retry of a request we still hold: keep one copy, route errors
        # to the sender's current connection, and extend its deadline.
        existing.client = client.identity
        existing.deadline = max(existing.deadline, now + float(header.timeout))
        self.ctx.metrics.duplicate_requests.inc()
        return True

    def accept(self, client: ClientState, request: Request, pinned: WorkerState | None, now: float) -> None:
        """Hold ``request``: straight to the worker it is ``pinned`` to, or queued for the service's pool; or,
        sent again by a client the broker forgot while a worker ran it, back on that worker (``reattach``)."""
        self.requests[request.request_id] = request
        client.requests.add(request.request_id)
        service = self.services.service(request.service, now)
        if self.reattach(request, now):
            return
        self.ctx.metrics.requests.labels(service=request.service).inc()
        if pinned is not None:
            self.send_request(service, pinned, request)
            return
        self.services.push(request)
        self.dispatch(service)

    # ------------------------------------------------------------------ dispatch

    def dispatch(self, service: ServiceState) -> None:
        """Hand queued requests to free workers: round-robin over clients, each request to the first worker
        of its ranking (ranking.py)."""
        while service.queues:
            pool = self.workers.of(service)
            free = ranking.free(pool, self.requests)
            if not free:
                return
            picked = self.services.next_request(service, functools.partial(ranking.eligible, candidates=free,
                                                                           pool=pool))
            if picked is None:
                return
            request, eligible = picked
            self.send_request(service, ranking.best(request, eligible), request)

    def send_request(self, service: ServiceState, worker: WorkerState, request: Request) -> None:
        """Send ``request`` to ``worker``, preceded by the vocab mapping it names if the worker lacks it."""
        vocab = request.header.vocab
        if vocab is not None:
            if vocab not in worker.mappings and vocab not in service.mappings:
                self.clients.forget_request(request)
                self.ctx.send_error(request.client, request.request_id, ErrorCode.BAD_REQUEST,
                                    f"vocab mapping {vocab!r} is no longer registered", unknown_vocab=True)
                return
            set_vocab = self.vocab.install(service, worker, vocab, self.requests)
            if set_vocab is not None:
                self.ctx.to_worker(worker.identity, set_vocab)
        header = dataclasses.replace(request.header, client=request.client.hex())
        frames = control(WORKER_TAG, WorkerCommand.REQUEST.value, service.name, request.request_id, header,
                         request.payload)
        if not self.ctx.to_worker(worker.identity, frames):
            self.services.push(request, front=True)
            self.unreachable(worker)
            return
        request.worker = worker.identity
        request.dispatches += 1
        request.dispatched_at = time.monotonic()
        worker.hold(request.request_id, request.dispatched_at)
        self.supply.dispatched(service, request, request.dispatched_at)

    # ------------------------------------------------------------------ answers and losses

    def complete(self, worker: WorkerState, request_id: bytes, done: Done, now: float) -> None:
        """DONE: the worker answered a request (or failed to deliver it); its slot is free again."""
        worker.let_go(request_id, now)
        worker.idle_since = now
        worker.leaving = worker.leaving or done.status is DoneStatus.ENGINE_DEAD
        request = self.requests.get(request_id)
        if done.status is DoneStatus.RETURNED and request is not None and request.worker == worker.identity:
            # Handed back unrun by a draining worker: to the front of its queue, for another worker now.
            self._orphaned(worker, request, "returned by its worker", died=False)
        elif request is not None and request.worker == worker.identity:
            del self.requests[request_id]
            client = self.clients.get(request.client)
            if client is not None:
                client.requests.discard(request_id)
            status = self._count_done(worker, done, request.enqueued_at, now)
            if status is DoneStatus.UNDELIVERABLE and client is not None:
                # The worker dropped the reply at once (its slot is free): the client retries now,
                # instead of waiting out its timeout.
                self.ctx.send_error(request.client, request_id, ErrorCode.UNAVAILABLE,
                                    f"worker {worker.name} could not deliver the reply to "
                                    f"{request.header.reply_to}: {'not reading' if done.error is None else done.error}")
        elif self.detached.get(request_id, (None,))[0] == worker.identity:
            _, enqueued_at = self.detached.pop(request_id)
            if done.status is not DoneStatus.RETURNED:  # handed back unrun: nobody waits for it any more
                self._count_done(worker, done, enqueued_at, now)
        self.dispatch(self.services[worker.service])

    def reattach(self, request: Request, now: float) -> bool:
        """``request`` is one the broker detached when it forgot its client (the client was only late, and sent
        it again) and its worker still runs it: held again as that worker's, not sent a second time (its reply
        goes to the client as it would have; if the worker dies, it is re-dispatched as any other). True if so."""
        held_by = self.detached.get(request.request_id, (None,))[0]
        worker = self.workers.get(held_by) if held_by is not None else None
        if worker is None or request.header.pin is not None:
            return False
        _, request.enqueued_at = self.detached.pop(request.request_id)
        request.worker = worker.identity
        request.dispatched_at = now
        request.dispatches += 1
        worker.hold(request.request_id, now)
        return True

    def detach(self, request: Request) -> None:
        """``request`` is on a worker and its client left: it is forgotten, but its DONE is still counted."""
        assert request.worker is not None
        self.detached[request.request_id] = (request.worker, request.enqueued_at)
        while len(self.detached) > MAX_DETACHED_IDS:
            self.detached.popitem(last=False)

    def _count_done(self, worker: WorkerState, done: Done, enqueued_at: float, now: float) -> DoneStatus:
        """Count a request's DONE in the metrics (an engine's death as an error); returns its status as counted."""
        status = done.status if done.status.value in DONE_STATUSES else DoneStatus.ERROR
        metrics = self.ctx.metrics
        metrics.completed.labels(service=worker.service, status=status.value).inc()
        if status is DoneStatus.OK:
            worker.completed += 1
            worker.tokens += done.tokens or 0
            metrics.tokens.labels(service=worker.service).inc(done.tokens or 0)
            metrics.reply_bytes.labels(service=worker.service).inc(done.nbytes or 0)
            metrics.latency.labels(service=worker.service).observe(now - enqueued_at)
        return status

    def orphan(self, service: ServiceState, worker: WorkerState, reason: str, died: bool) -> None:
        """``worker`` is gone: each request it held goes back to the front of its queue, or fails (pinned, or
        on ``max_request_deaths`` workers as they ``died``), or is dropped (its client left)."""
        for request_id in worker.inflight:
            request = self.requests.get(request_id)
            if request is None or request.worker != worker.identity:  # gone, or taken from it at its deadline
                continue
            self._orphaned(worker, request, reason, died)
        worker.inflight.clear()

    def _orphaned(self, worker: WorkerState, request: Request, reason: str, died: bool) -> None:
        request.worker = None
        if request.header.pin is not None:
            # The worker it was pinned to is gone: the client re-sends it to the pool.
            self.clients.forget_request(request)
            self.ctx.send_error(request.client, request.request_id, ErrorCode.UNAVAILABLE,
                                f"bound worker {worker.name} is gone ({reason})", unpinned=True)
        elif died and self._killed_by(request, worker):
            return
        elif request.client in self.clients.clients:
            self.services.push(request, front=True)
            self.ctx.metrics.redispatched.inc()
        else:
            del self.requests[request.request_id]

    def _killed_by(self, request: Request, worker: WorkerState) -> bool:
        """Count ``worker``'s death against ``request``; True if that failed the request for good."""
        error = self.poison.died_on(request, worker)
        if error is None:
            return False  # a suspect from now on: dispatched alone (ranking.isolated)
        self.clients.forget_request(request)
        if request.client in self.clients.clients:
            self.ctx.send_error(request.client, request.request_id, ErrorCode.KILLED_WORKERS, error)
        return True

    # ------------------------------------------------------------------ deadlines

    def expire(self, now: float) -> None:
        """Requests past their deadline: on a worker (``deadline_missed``) or still queued (failed)."""
        for request in [r for r in self.requests.values()
                        if r.worker is not None and now > r.dispatched_at + float(r.header.timeout)]:
            self.deadline_missed(request)
        for service in self.services:
            self.services.expire(service, now, self.clients.forget_request)

    def deadline_missed(self, request: Request) -> None:
        """Its worker held it past its timeout: dead for this request. It goes to another worker with a
        fresh deadline (the slot stays taken until the worker answers; a late DONE is ignored, a late
        reply the client drops as a duplicate)."""
        held_by = request.worker
        if held_by is None:  # only a dispatched request can miss its deadline; expire() picks only those
            return
        worker = self.workers.get(held_by)
        event(log, logging.WARNING, "broker.deadline_missed", request=request.request_id.hex()[:12],
              worker=worker.name if worker else held_by.hex()[:12])
        request.missed.add(held_by)
        request.worker = None
        if request.header.pin is not None:  # its worker is no use: the client re-sends it to the pool
            self.clients.forget_request(request)
            name = worker.name if worker else "?"
            self.ctx.send_error(request.client, request.request_id, ErrorCode.UNAVAILABLE,
                                f"bound worker {name} missed the request's deadline", unpinned=True)
            return
        request.deadline = max(request.deadline, time.monotonic() + float(request.header.timeout))
        self.services.push(request, front=True)
        self.ctx.metrics.redispatched.inc()
        self.dispatch(self.services[request.service])
