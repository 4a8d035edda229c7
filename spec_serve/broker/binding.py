"""NCCL binding negotiation at the broker (docs/nccl.md): a client takes a worker of its own.

The broker only picks the worker and keeps the record (``WorkerState.bound_to``); the worker grants
the binding itself, sending the client the rendezvous over its data socket.
"""

from __future__ import annotations

import logging
import uuid

from spec_serve.broker.clients import ClientTable
from spec_serve.broker.context import BrokerContext
from spec_serve.broker.dispatch import Dispatcher
from spec_serve.broker.services import ServiceQueues
from spec_serve.broker.state import ClientState, WorkerState
from spec_serve.broker.workers import WorkerRegistry
from spec_serve.protocol.commands import (
    CLIENT_TAG,
    WORKER_TAG,
    ClientCommand,
    ErrorCode,
    Message,
    ProtocolError,
    WorkerCommand,
    control,
)
from spec_serve.protocol.messages import BindRequest, Bound, Release, WorkerBind
from spec_serve.telemetry.logs import event

log = logging.getLogger("spec_serve.broker")


class Bindings:
    """BIND, RELEASE and the end of a binding, over the registry's workers."""

    def __init__(self, ctx: BrokerContext, services: ServiceQueues, workers: WorkerRegistry, clients: ClientTable,
                 dispatcher: Dispatcher):
        self.ctx = ctx
        self.services = services
        self.workers = workers
        self.clients = clients
        self.dispatcher = dispatcher

    def bind(self, client: ClientState, msg: Message, now: float) -> None:
        """Give the client a worker of its own: refused at once (BOUND ok=false) when none is free;
        granted by the worker itself, which sends the client the rendezvous over its data socket."""
        if not msg.request_id:
            raise ProtocolError("BIND without a request id")
        request = BindRequest.from_json(msg.header)
        self.unbind_client(client.identity, "its client bound again")  # one binding per client
        worker = self._pick(client, msg)
        if worker is None:
            return
        prefix = uuid.uuid4().hex
        worker.bound_to, worker.bind_prefix, worker.bind_request = client.identity, prefix, msg.request_id
        header = WorkerBind(client=client.identity.hex(), reply_to=request.reply_to, prefix=prefix,
                            timeout=float(request.timeout), device_type=request.device_type, data_key=request.data_key)
        if not self.ctx.to_worker(worker.identity, control(WORKER_TAG, WorkerCommand.BIND.value, msg.service,
                                                           msg.request_id, header)):
            worker.bound_to, worker.bind_prefix, worker.bind_request = None, None, b""
            self._refuse(client, msg, f"worker {worker.name} unreachable")
            return
        event(log, logging.INFO, "broker.bound", worker=worker.name, client=client.identity.hex()[:12])
        self.ctx.status_stale = True

    def _pick(self, client: ClientState, msg: Message) -> WorkerState | None:
        """The worker to bind, preferring an idle one (a busy one finishes the jobs it holds first: BIND
        queues behind them); None, after refusing the BIND, if every worker is bound or leaving."""
        service = self.services.get(msg.service)
        workers = self.workers.of(service) if service else []
        candidates = [w for w in workers if w.bound_to is None and not w.leaving]
        if candidates:
            return min(candidates, key=lambda w: (len(w.inflight), w.idle_since))
        error = (f"all {len(workers)} workers of service {msg.service!r} are bound to other clients" if workers
                 else f"no worker of service {msg.service!r} is registered")
        self.ctx.metrics.errors.labels(code=ErrorCode.UNAVAILABLE.value).inc()
        self._refuse(client, msg, error)
        return None

    def _refuse(self, client: ClientState, msg: Message, error: str) -> None:
        refusal = Bound(ok=False, code=ErrorCode.UNAVAILABLE.value, error=error)
        self.ctx.to_client(client.identity, control(CLIENT_TAG, ClientCommand.BOUND.value, msg.service,
                                                    msg.request_id, refusal))

    def release(self, client: ClientState, msg: Message, now: float) -> None:
        """RELEASE: end the client's binding named by ``prefix``, or all of them without one."""
        prefix = Release.from_json(msg.header).prefix
        for worker in self.bound_to(client.identity):
            if prefix is None or prefix == worker.bind_prefix:
                self.unbind(worker, "released by its client")

    def bound_worker(self, client: ClientState, msg: Message, name: str) -> WorkerState | None:
        """The worker ``name`` a bound request names (it goes there only, never queued for the pool); None
        after telling the client it has no such binding."""
        bound = next((w for w in self.bound_to(client.identity) if w.name == name and w.service == msg.service), None)
        if bound is None:
            self.ctx.send_error(client.identity, msg.request_id, ErrorCode.UNAVAILABLE,
                                f"no worker {name!r} of {msg.service!r} is bound to this client", unbound=True)
        return bound

    def bound_to(self, client: bytes) -> list[WorkerState]:
        return [w for w in self.workers.workers.values() if w.bound_to == client]

    def unbind_client(self, client: bytes, reason: str) -> None:
        for worker in self.bound_to(client):
            self.unbind(worker, reason)

    def unbind(self, worker: WorkerState, reason: str, notify: bool = False) -> None:
        """End a binding: tell the worker (if alive) and, with ``notify``, the client; back to the pool."""
        client, prefix, request_id = worker.bound_to, worker.bind_prefix, worker.bind_request
        if client is None:
            return
        worker.bound_to, worker.bind_prefix, worker.bind_request = None, None, b""
        alive = worker.identity in self.workers.workers
        if alive:
            self.ctx.to_worker(worker.identity, control(WORKER_TAG, WorkerCommand.RELEASE.value, worker.service,
                                                        b"", Release(prefix)))
        if notify and self.clients.get(client) is not None:
            lost = Bound(ok=False, lost=worker.name, prefix=prefix, error=f"bound worker {worker.name} lost: {reason}")
            self.ctx.to_client(client, control(CLIENT_TAG, ClientCommand.BOUND.value, worker.service, request_id, lost))
        event(log, logging.INFO, "broker.unbound", worker=worker.name, client=client.hex()[:12], reason=reason)
        self.ctx.status_stale = True
        if alive:
            self.dispatcher.dispatch(self.services[worker.service])
