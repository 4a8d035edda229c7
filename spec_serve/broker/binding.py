"""Bindings at the broker: a client takes a worker of its own (for a reply path that needs one), and its
requests name that worker as their ``pin``.

The broker only picks the worker and keeps the record (``WorkerState.bound_to``); the worker grants
the binding itself, sending the client the rendezvous over its data socket, and tells the broker with a
DONE for the BIND's request id.

A binding takes a worker out of the pool on a client's word, so the broker undoes it without the client:
- when the worker refuses it or cannot deliver the grant (its DONE for the BIND is not ``ok``);
- when the client goes (DISCONNECT, expiry), or the worker does;
- when it is idle: no request on the worker for BIND_IDLE_S (the client rebinds on its next call);
- when another client's requests wait and every worker of the service is bound (``make_room``).
And a client binds one worker at most, never the last unbound worker of a service that another client
without a binding uses: no client holds more than its share of the pool.
"""

from __future__ import annotations

import logging
import uuid

from spec_serve.broker.clients import ClientTable
from spec_serve.broker.context import BrokerContext
from spec_serve.broker.dispatch import Dispatcher
from spec_serve.broker.services import ServiceQueues
from spec_serve.broker.state import ClientState, ServiceState, WorkerState
from spec_serve.broker.workers import WorkerRegistry
from spec_serve.protocol.commands import (
    CLIENT_TAG,
    WORKER_TAG,
    ClientCommand,
    DoneStatus,
    ErrorCode,
    Message,
    ProtocolError,
    WorkerCommand,
    control,
    env_float,
)
from spec_serve.protocol.messages import BindRequest, Bound, Done, Release, WorkerBind
from spec_serve.telemetry.logs import event

log = logging.getLogger("spec_serve.broker")

# A binding with no request on its worker for this long ends (BOUND lost); its client rebinds on its next call.
BIND_IDLE_S = env_float("SPEC_SERVE_BIND_IDLE", 60.0)
# The rendezvous timeout a BIND may ask of a worker: the worker's compute thread waits up to this long for a
# client that never joins. A larger one is cut to it.
MAX_BIND_TIMEOUT_S = 120.0


class Bindings:
    """BIND, RELEASE and the end of a binding, over the registry's workers. ``refusal``: why this broker
    refuses every BIND (None: it takes them)."""

    def __init__(self, ctx: BrokerContext, services: ServiceQueues, workers: WorkerRegistry, clients: ClientTable,
                 dispatcher: Dispatcher, refusal: str | None = None):
        self.ctx = ctx
        self.services = services
        self.workers = workers
        self.clients = clients
        self.dispatcher = dispatcher
        self.refusal = refusal

    def bind(self, client: ClientState, msg: Message, request: BindRequest, now: float) -> None:
        """Give the client a worker of its own: refused at once (BOUND ok=false) when none may be bound;
        granted by the worker itself, which sends the client the rendezvous over its data socket."""
        if not msg.request_id:
            raise ProtocolError("BIND without a request id")
        self.unbind_client(client.identity, "its client bound again")  # one binding per client
        worker = self._pick(client, msg)
        if worker is None:
            return
        prefix = uuid.uuid4().hex
        worker.bound_to, worker.bind_prefix, worker.bind_request = client.identity, prefix, msg.request_id
        worker.bound_at = now
        header = WorkerBind(client=client.identity.hex(), reply_to=request.reply_to, prefix=prefix,
                            timeout=min(float(request.timeout), MAX_BIND_TIMEOUT_S), device_type=request.device_type,
                            data_key=request.data_key)
        if not self.ctx.to_worker(worker.identity, control(WORKER_TAG, WorkerCommand.BIND.value, msg.service,
                                                           msg.request_id, header)):
            worker.bound_to, worker.bind_prefix, worker.bind_request = None, None, b""
            self._refuse(client, msg, f"worker {worker.name} unreachable")
            return
        self.clients.uses(client, msg.service)
        event(log, logging.INFO, "broker.bound", worker=worker.name, client=client.identity.hex()[:12])
        self.ctx.status_stale = True

    def _pick(self, client: ClientState, msg: Message) -> WorkerState | None:
        """The worker to bind, preferring an idle one (a busy one finishes the jobs it holds first: BIND
        queues behind them); None, after refusing the BIND, if none may be bound."""
        service = self.services.get(msg.service)
        workers = self.workers.of(service) if service else []
        candidates = [w for w in workers if w.bound_to is None and not w.leaving]
        waiting = self._pool_users(msg.service, besides=client.identity)
        if self.refusal is not None:
            error = self.refusal
        elif not candidates:
            error = (f"all {len(workers)} workers of service {msg.service!r} are bound to other clients" if workers
                     else f"no worker of service {msg.service!r} is registered")
        elif len(candidates) == 1 and waiting:
            error = (f"the last unbound worker of service {msg.service!r} stays in the pool: {waiting} other "
                     f"client(s) without a binding use it")
        else:
            return min(candidates, key=lambda w: (len(w.inflight), w.idle_since))
        self.ctx.metrics.errors.labels(code=ErrorCode.UNAVAILABLE.value).inc()
        self._refuse(client, msg, error)
        return None

    def _pool_users(self, service: str, besides: bytes) -> int:
        """Connected clients of ``service`` other than ``besides`` that hold no binding: they need the pool."""
        bound = {w.bound_to for w in self.workers.workers.values()}
        return sum(1 for c in self.clients.users(service) if c.identity != besides and c.identity not in bound)

    def _refuse(self, client: ClientState, msg: Message, error: str) -> None:
        refusal = Bound(ok=False, code=ErrorCode.UNAVAILABLE.value, error=error)
        self.ctx.to_client(client.identity, control(CLIENT_TAG, ClientCommand.BOUND.value, msg.service,
                                                    msg.request_id, refusal))

    def release(self, client: ClientState, msg: Message, release: Release, now: float) -> None:
        """RELEASE: end the client's binding named by ``prefix``, or all of them without one."""
        prefix = release.prefix
        for worker in self.bound_to(client.identity):
            if prefix is None or prefix == worker.bind_prefix:
                self.unbind(worker, "released by its client")

    def bound_worker(self, client: ClientState, msg: Message, name: str) -> WorkerState | None:
        """The worker ``name`` a pinned request names (it goes there only, never queued for the pool); None
        after telling the client it has no such binding."""
        bound = next((w for w in self.bound_to(client.identity) if w.name == name and w.service == msg.service), None)
        if bound is None:
            self.ctx.send_error(client.identity, msg.request_id, ErrorCode.UNAVAILABLE,
                                f"no worker {name!r} of {msg.service!r} is bound to this client", unpinned=True)
        return bound

    def bound_to(self, client: bytes) -> list[WorkerState]:
        return [w for w in self.workers.workers.values() if w.bound_to == client]

    def unbind_client(self, client: bytes, reason: str) -> None:
        for worker in self.bound_to(client):
            self.unbind(worker, reason)

    def answered(self, worker: WorkerState, request_id: bytes, done: Done) -> None:
        """A DONE from ``worker``: if it answers the BIND of its binding, ``ok`` means the worker granted it,
        anything else ends the binding. The client is told only if the worker's answer did not reach it
        (``undeliverable``); a refusal the worker sent it already."""
        if worker.bound_to is None or not request_id or request_id != worker.bind_request \
                or done.status is DoneStatus.OK:
            return
        why = f": {done.error}" if done.error else ""
        self.unbind(worker, f"the worker did not grant the BIND (DONE {done.status.value}{why})",
                    notify=done.status is DoneStatus.UNDELIVERABLE)

    def expire(self, now: float) -> None:
        """End bindings idle for BIND_IDLE_S: no request on the worker since the BIND or its last DONE."""
        for worker in list(self.workers.workers.values()):
            if worker.bound_to is not None and not worker.inflight \
                    and now - max(worker.bound_at, worker.idle_since) > BIND_IDLE_S:
                self.unbind(worker, f"idle for {BIND_IDLE_S:g}s", notify=True)

    def make_room(self, service: ServiceState) -> None:
        """Requests of clients without a binding wait and every worker of ``service`` is bound: the newest
        binding ends (its client falls back to frames), so the pool is never empty while someone needs it."""
        workers = [w for w in self.workers.of(service) if not w.leaving]
        if not workers or any(w.bound_to is None for w in workers):
            return
        bound = {w.bound_to for w in workers}
        if not any(client not in bound for client in service.queues):
            return
        newest = max(workers, key=lambda w: w.bound_at)
        self.unbind(newest, "requests of clients without a binding wait and every worker is bound", notify=True)

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
