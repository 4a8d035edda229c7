"""Routing: the broker's parts, put together, and the handlers its loop calls for each command.

Each part has one job: ``WorkerRegistry`` (workers.py) who is registered, ``ServiceQueues`` (services.py)
services and their fair queues, ``Dispatcher`` (dispatch.py) dispatch and re-dispatch, ``Bindings``
(binding.py) bindings (a worker a client holds, which its requests' ``pin`` names), ``ClientTable``
(clients.py) client state and what clients may hold. The
router only sequences them where one event touches several (a worker or client that goes, a request that
arrives) and runs the periodic ``heartbeat`` and ``purge``. Nothing here owns a socket: every part sends
through the injected ``send(peer, identity, frames)`` (context.py), so all of it runs under a test without
sockets. Method names follow the Majordomo spec: ``dispatch``, ``purge``, ``heartbeat``.
"""

from __future__ import annotations

import logging
import time

from spec_serve.broker.binding import Bindings
from spec_serve.broker.clients import DEFAULT_CLIENT_HELD_SHARE, DEFAULT_MAX_HELD_BYTES, ClientTable
from spec_serve.broker.context import BrokerContext, Send
from spec_serve.broker.dispatch import Dispatcher
from spec_serve.broker.services import ServiceQueues
from spec_serve.broker.state import ClientState, Request, RequestTable, WorkerState
from spec_serve.broker.supply import SupplyDemand
from spec_serve.broker.vocab_registry import VocabRegistry
from spec_serve.broker.workers import WorkerRegistry
from spec_serve.protocol.commands import (
    CLIENT_TAG,
    WORKER_TAG,
    ClientCommand,
    Message,
    ProtocolError,
    WorkerCommand,
    control,
)
from spec_serve.protocol.messages import (
    BrokerHeartbeat,
    ClientHeartbeat,
    Disconnect,
    Done,
    Leave,
    Ready,
    SetVocab,
    SupervisionRequest,
)
from spec_serve.telemetry.logs import event
from spec_serve.telemetry.metrics import BrokerMetrics

log = logging.getLogger("spec_serve.broker")

# Seconds of history the supply-and-demand figures and the advice cover (--sizing-window).
DEFAULT_SIZING_WINDOW = 60.0


class Router:
    """The broker's state and decisions, by part; single-threaded (the broker loop calls it)."""

    def __init__(
        self,
        send: Send,
        *,
        heartbeat_interval: float,
        liveness: int,
        max_message_bytes: int,
        max_request_deaths: int = 2,
        max_held_bytes: int = DEFAULT_MAX_HELD_BYTES,
        client_held_share: float = DEFAULT_CLIENT_HELD_SHARE,
        metrics: BrokerMetrics | None = None,
        bind_refusal: str | None = None,
        sizing_window: float = DEFAULT_SIZING_WINDOW,
    ):
        self.ctx = BrokerContext(send, heartbeat_interval=heartbeat_interval, liveness=liveness, metrics=metrics)
        self.metrics = self.ctx.metrics
        # A request must fit what the broker may hold.
        self.max_message_bytes = min(max_message_bytes, max_held_bytes)
        self.requests = RequestTable()
        self.supply = SupplyDemand(self.ctx, sizing_window)
        self.vocab = VocabRegistry(self.max_message_bytes)
        self.queues = ServiceQueues(self.ctx, self.requests)
        self.registry = WorkerRegistry(self.ctx, self.queues)
        self.client_table = ClientTable(self.ctx, self.queues, self.registry, self.requests, self.vocab,
                                        max_message_bytes=self.max_message_bytes, max_held_bytes=max_held_bytes,
                                        client_held_share=client_held_share)
        self.dispatcher = Dispatcher(self.ctx, self.queues, self.registry, self.client_table, self.requests,
                                     self.vocab, self.supply, max_request_deaths=max_request_deaths,
                                     unreachable=self._unreachable)
        self.bindings = Bindings(self.ctx, self.queues, self.registry, self.client_table, self.dispatcher,
                                 refusal=bind_refusal)
        # What status.py reads, by name.
        self.workers = self.registry.workers
        self.services = self.queues.services
        self.served = self.queues.served
        self.clients = self.client_table.clients
        self.instance_id = self.ctx.instance_id
        self.started_at = self.ctx.started_at

    @property
    def expiry_window(self) -> float:
        return self.ctx.expiry_window

    @property
    def status_stale(self) -> bool:
        return self.ctx.status_stale

    @status_stale.setter
    def status_stale(self, value: bool) -> None:
        self.ctx.status_stale = value

    # ------------------------------------------------------------------ clients

    def client_seen(self, identity: bytes, now: float) -> ClientState:
        return self.client_table.seen(identity, now)

    def enqueue(self, client: ClientState, msg: Message, header: SupervisionRequest, now: float) -> None:
        """REQUEST: queue it for the service's pool, or send it straight to the worker it is pinned to (one the
        client holds: a binding)."""
        if not msg.request_id:
            raise ProtocolError("REQUEST without a request id")
        if self.dispatcher.seen_before(client, msg, header, now):
            return
        size = self.client_table.admit(client, msg, header, now)
        if size is None:
            return
        pinned = None
        if header.pin is not None:
            pinned = self.bindings.bound_worker(client, msg, header.pin)
            if pinned is None:
                return
        request = Request(msg.request_id, client.identity, msg.service, header, msg.payload,
                          now + float(header.timeout), now, size)
        if header.is_generate:
            self.supply.asked(self.queues.service(msg.service, now), client.identity, header.tokens or 0, now)
        self.dispatcher.accept(client, request, pinned, now)

    def client_heartbeat(self, client: ClientState, msg: Message, header: None, now: float) -> None:
        """HEARTBEAT: receiving it extended the client's expiry; its header may report its rank's demand. Read
        here, not before (CLIENT_HEADERS has none for it): a report that does not check out is counted and
        dropped, never an error to the client."""
        try:
            beat = ClientHeartbeat.from_json(msg.header)
        except ProtocolError:
            self.supply.rejected()
            return
        self.supply.reported(client, msg.service, beat, now)

    def register_mapping(self, client: ClientState, msg: Message, header: SetVocab, now: float) -> None:
        """SET_VOCAB."""
        self.client_table.register_mapping(client, msg, header, now)

    def disconnect(self, client: ClientState, msg: Message, header: None, now: float) -> None:
        """DISCONNECT: the client asks to be forgotten."""
        self.delete_client(client.identity)

    def forget_silent_client(self, identity: bytes) -> None:
        """A client silent past its liveness window: forgotten, and told so (DISCONNECT). One that is only late
        (a loaded host) hears it, and registers its mappings and sends what it has pending again before its
        next request, rather than finding its mappings gone."""
        self.ctx.to_client(identity, control(CLIENT_TAG, ClientCommand.DISCONNECT.value, header=Disconnect()))
        self.delete_client(identity)

    def delete_client(self, identity: bytes) -> None:
        """Forget a client: drop what it queued; what runs finishes and is discarded."""
        client = self.client_table.pop(identity)
        if client is None:
            return
        self.bindings.unbind_client(identity, "client gone")
        freed = set()
        for request_id in client.requests:
            request = self.requests.pop(request_id, None)
            if request is not None and request.worker is not None:
                # Its worker finishes (its DONE is still counted), but the slot is free now: a vanished
                # client must not hold a worker for the reply timeout.
                self.dispatcher.detach(request)
                worker = self.registry.get(request.worker)
                if worker is not None:
                    worker.let_go(request_id, time.monotonic())
                    freed.add(worker.service)
        self.queues.drop_client(identity)
        event(log, logging.INFO, "broker.client_gone", client=identity.hex()[:12])
        for name in freed:
            self.dispatcher.dispatch(self.queues[name])

    # ------------------------------------------------------------------ workers

    def worker_ready(self, identity: bytes, msg: Message, ready: Ready, now: float) -> None:
        """READY: register the worker, replacing its earlier registration if it had one."""
        worker = self.registry.get(identity)
        if worker is not None:
            self.delete_worker(worker, now, reason="re-registered", died=False)
        worker = self.registry.register(identity, msg, ready, now, self.client_table.pinned(msg.service))
        if worker is not None:
            self.dispatcher.dispatch(self.queues[worker.service])

    def worker_seen(self, identity: bytes, now: float) -> WorkerState | None:
        return self.registry.seen(identity, now)

    def worker_left(self, worker: WorkerState, msg: Message, leave: Leave, now: float) -> None:
        """LEAVE. With ``drain`` (the worker was told to stop): it gets nothing more, its binding ends, and it
        finishes or hands back (DONE returned) what it holds before it LEAVEs for good. Otherwise it goes
        now (its engine died, or it stopped): what it still holds goes elsewhere. The request a dead engine
        was running got engine_dead already; the rest were never run: no suspects."""
        reason = str(leave.reason)[:200]
        if leave.drain:
            worker.leaving = worker.draining = True
            self.bindings.unbind(worker, "its worker is stopping", notify=True)
            event(log, logging.INFO, "broker.worker_draining", worker=worker.name, service=worker.service,
                  holds=len(worker.inflight), reason=reason)
            self.status_stale = True
            return
        if not worker.draining:
            self.metrics.worker_deaths.inc()
        self.delete_worker(worker, now, reason=f"left: {reason}", died=False)

    def delete_worker(self, worker: WorkerState, now: float, reason: str, died: bool = True) -> None:
        """Remove a worker; its in-flight requests go back to the front of their queues, except one
        that was on ``max_request_deaths`` workers as they ``died``: that one fails (killed_workers)."""
        service = self.registry.remove(worker, reason)
        self.dispatcher.orphan(service, worker, reason, died)
        self.bindings.unbind(worker, reason, notify=True)
        self.dispatcher.dispatch(service)

    def _unreachable(self, worker: WorkerState) -> None:
        self.delete_worker(worker, time.monotonic(), reason="unreachable", died=True)

    def complete(self, worker: WorkerState, msg: Message, done: Done, now: float) -> None:
        """DONE: for a request, or for the BIND the worker answered."""
        self.bindings.answered(worker, msg.request_id, done)
        self.dispatcher.complete(worker, msg.request_id, done, now)

    def in_use(self) -> set[str]:
        """The services someone asks for: named by a connected client, or by a request the broker holds."""
        return self.client_table.in_use() | {r.service for r in self.requests.values()}

    # ------------------------------------------------------------------ heartbeat and purge

    def heartbeat(self, now: float) -> None:
        beat = control(WORKER_TAG, WorkerCommand.HEARTBEAT.value)
        for worker in list(self.workers.values()):
            self.ctx.to_worker(worker.identity, beat)
        beat = control(CLIENT_TAG, ClientCommand.HEARTBEAT.value, header=BrokerHeartbeat(self.instance_id))
        for identity in list(self.clients):
            if not self.ctx.to_client(identity, beat):
                self.delete_client(identity)

    def measure(self, now: float) -> None:
        """Once a tick: supply and demand per service, and the advice (supply.py)."""
        self.supply.sample(self.services, self.workers, self.clients, now)

    def purge(self, now: float) -> None:
        """Expire silent workers and clients, and requests past their deadline."""
        for worker in [w for w in self.workers.values() if w.expiry < now]:
            self.metrics.worker_deaths.inc()
            self.delete_worker(worker, now, reason="heartbeat expired", died=True)
        for identity in [c.identity for c in self.clients.values() if c.expiry < now]:
            self.forget_silent_client(identity)
        self.dispatcher.expire(now)
        self.bindings.expire(now)
        for service in self.queues:
            self.bindings.make_room(service)
        self.client_table.trim_mappings()
        self.queues.forget_unused(self.in_use())
        self.queues.update_metrics()
        self.metrics.inflight.set(sum(1 for r in self.requests.values() if r.worker is not None))
