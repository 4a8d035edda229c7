"""Routing: the broker's requests, workers, clients and services, and every decision on them.

Requests are queued per service and per client and dispatched fairly (round-robin over clients) to
the least-loaded worker; the router keeps the in-flight table, re-dispatches a dead worker's
requests, expires silent peers and requests past their deadline. It owns no socket: everything it
says goes through ``send(peer, identity, frames)``, which returns False if the peer is gone or
saturated, so it runs under a test without sockets. Method names follow the Majordomo spec:
``dispatch``, ``purge``, ``heartbeat``.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import time
import uuid
from collections.abc import Callable

from spec_serve.broker.binding import Bindings
from spec_serve.broker.state import ClientState, Request, RequestTable, ServiceState, WorkerState
from spec_serve.broker.vocab_registry import BadMapping, VocabRegistry
from spec_serve.protocol.commands import (
    CLIENT_TAG,
    IDLE_SERVICE_GRACE,
    UNKNOWN_SERVICE_GRACE,
    WORKER_TAG,
    ClientCommand,
    ErrorCode,
    Message,
    ProtocolError,
    WorkerCommand,
    control,
    encode_header,
)
from spec_serve.protocol.messages import (
    BrokerError,
    BrokerHeartbeat,
    Done,
    Leave,
    Ready,
    Refused,
    SetVocab,
    SupervisionRequest,
    VocabOk,
)
from spec_serve.supervision.contract import TargetInfo
from spec_serve.telemetry.logs import event
from spec_serve.telemetry.metrics import BrokerMetrics

log = logging.getLogger("spec_serve.broker")

# Requests one client may have queued or in flight at the broker; beyond this
# it is told to back off. Bounds broker memory whatever clients do.
MAX_REQUESTS_PER_CLIENT = 256
# Service names that ever had a worker, remembered after the service is forgotten (see _unknown).
MAX_SERVED_NAMES = 4096
# A worker's target info as sent in READY; real ones are a few hundred bytes.
MAX_TARGET_INFO_BYTES = 8 << 10
# What a worker's DONE may say; anything else counts as "error".
DONE_STATUSES = ("ok", "error", "undeliverable")
# Ids of requests failed for killing workers, refused if they come back (a retry that crossed the error).
MAX_KILLER_IDS = 1024
# Request and vocab-mapping payload bytes the broker holds at once (queued, in flight, stored);
# past it a new request is told to back off (unavailable, retried), a larger one is refused.
DEFAULT_MAX_HELD_BYTES = 1 << 30
# The share of --max-held-bytes one client (one connection) may hold, so that one peer cannot make the
# broker refuse everyone else; at least one request of the largest size.
DEFAULT_CLIENT_HELD_SHARE = 0.25
# Requests one worker may hold at once, whatever it claims: a claim of 10^6 must not draw the queue.
MAX_WORKER_CAPACITY = 64


class Peer(enum.Enum):
    """Whom a message goes to: the broker's frontend serves clients, its backend workers."""

    CLIENT = "client"
    WORKER = "worker"


Send = Callable[[Peer, bytes, list], bool]


class Router:
    """All routing state and decisions; single-threaded (the broker loop calls it)."""

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
    ):
        if max_request_deaths < 1:
            raise ValueError("max_request_deaths must be >= 1")
        self.send = send
        self.instance_id = uuid.uuid4().hex
        self.started_at = time.time()
        self.heartbeat_interval = heartbeat_interval
        self.liveness = liveness
        # A request must fit what the broker may hold.
        self.max_message_bytes = min(max_message_bytes, max_held_bytes)
        self.max_held_bytes = max_held_bytes
        self.max_client_bytes = max(int(max_held_bytes * client_held_share), self.max_message_bytes)
        # Payload bytes promised to messages still arriving in parts (the broker's broker.parts.Parts), held
        # as much as stored ones: of one client identity, or of everyone for None.
        self.reserved: Callable[[bytes | None], int] = lambda identity: 0
        # A request on this many workers as they died fails (killed_workers) instead of going to another.
        self.max_request_deaths = max_request_deaths
        self.metrics = metrics or BrokerMetrics()
        self.workers: dict[bytes, WorkerState] = {}
        self.services: dict[str, ServiceState] = {}
        self.clients: dict[bytes, ClientState] = {}
        self.requests = RequestTable()
        self.served: collections.OrderedDict[str, None] = collections.OrderedDict()  # names that had workers
        self.killers: collections.OrderedDict[bytes, str] = collections.OrderedDict()  # request id -> error
        self.vocab = VocabRegistry(self.max_message_bytes)
        self.bindings = Bindings(self)
        # Set when what status.py reports changed; the broker loop rebuilds its snapshot once per turn.
        self.status_stale = False

    # ------------------------------------------------------------------ sending

    def to_client(self, identity: bytes, frames: list) -> bool:
        return self.send(Peer.CLIENT, identity, frames)

    def to_worker(self, identity: bytes, frames: list) -> bool:
        return self.send(Peer.WORKER, identity, frames)

    def send_error(self, client: bytes, request_id: bytes, code: ErrorCode, message: str, *,
                   unknown_vocab: bool = False, unbound: bool = False) -> None:
        self.metrics.errors.labels(code=code.value).inc()
        error = BrokerError(code=code.value, error=message, unknown_vocab=unknown_vocab, unbound=unbound)
        self.to_client(client, control(CLIENT_TAG, ClientCommand.ERROR.value, "", request_id, error))

    @property
    def expiry_window(self) -> float:
        """Seconds a peer stays known without a message from it."""
        return self.heartbeat_interval * self.liveness

    # ------------------------------------------------------------------ clients

    def client_seen(self, identity: bytes, now: float) -> ClientState:
        """The client that sent a message now, known from now on if it was not."""
        client = self.clients.get(identity)
        if client is None:
            client = self.clients[identity] = ClientState(identity, now)
            self.metrics.clients.set(len(self.clients))
        client.expiry = now + self.expiry_window
        return client

    def enqueue(self, client: ClientState, msg: Message, now: float) -> None:
        """REQUEST: queue it for the service's pool, or send it straight to the client's bound worker."""
        if not msg.request_id:
            raise ProtocolError("REQUEST without a request id")
        header = SupervisionRequest.from_json(msg.header)
        timeout = float(header.timeout)
        if msg.request_id in self.killers:  # a retry that crossed its killed_workers error
            self.send_error(client.identity, msg.request_id, ErrorCode.KILLED_WORKERS, self.killers[msg.request_id])
            return
        existing = self.requests.get(msg.request_id)
        if existing is not None:
            # A retry of a request we still hold: keep one copy, route errors
            # to the sender's current connection, and extend its deadline.
            existing.client = client.identity
            existing.deadline = max(existing.deadline, now + timeout)
            self.metrics.duplicate_requests.inc()
            return
        size = self._admit(client, msg, header, now)
        if size is None:
            return
        bound = None
        if header.bound is not None:
            bound = self._bound_worker(client, msg, header.bound)
            if bound is None:
                return
        request = Request(msg.request_id, client.identity, msg.service, header, msg.payload, now + timeout, now, size)
        self.requests[msg.request_id] = request
        client.requests.add(msg.request_id)
        service = self.service(msg.service, now)
        self.metrics.requests.labels(service=msg.service).inc()
        if bound is not None:
            self.send_request(service, bound, request)
            return
        service.queues.setdefault(client.identity, collections.deque()).append(msg.request_id)
        self.dispatch(service)

    def _admit(self, client: ClientState, msg: Message, header: SupervisionRequest, now: float) -> int | None:
        """A new request's payload bytes if the broker takes it; None after answering why not."""
        if len(client.requests) >= MAX_REQUESTS_PER_CLIENT:
            self.send_error(client.identity, msg.request_id, ErrorCode.UNAVAILABLE,
                            f"more than {MAX_REQUESTS_PER_CLIENT} requests outstanding for this client")
            return None
        if not self.pin_target(client, msg, header.fingerprint):
            return None
        size = sum(len(memoryview(f)) for f in msg.payload)
        if size > self.max_message_bytes:
            self.send_error(client.identity, msg.request_id, ErrorCode.BAD_REQUEST,
                            f"request of {size} bytes exceeds the limit of {self.max_message_bytes}")
            return None
        if not self._can_hold(client, msg.request_id, size):
            return None
        vocab = header.vocab
        service = self.services.get(msg.service)
        if vocab is not None and (service is None or vocab not in service.mappings):
            self.send_error(client.identity, msg.request_id, ErrorCode.BAD_REQUEST,
                            f"unknown vocab mapping {vocab!r}: call set_vocab_mapping first", unknown_vocab=True)
            return None
        if self._unknown(msg.service, now):
            self.send_error(client.identity, msg.request_id, ErrorCode.UNKNOWN_SERVICE,
                            self._unknown_message(msg.service))
            return None
        return size

    def _bound_worker(self, client: ClientState, msg: Message, name: str) -> WorkerState | None:
        """The worker ``name`` a bound request names (it goes there only, never queued for the pool); None
        after telling the client it has no such binding."""
        bound = next((w for w in self.workers.values() if w.bound_to == client.identity
                      and w.name == name and w.service == msg.service), None)
        if bound is None:
            self.send_error(client.identity, msg.request_id, ErrorCode.UNAVAILABLE,
                            f"no worker {name!r} of {msg.service!r} is bound to this client",
                            unbound=True)
        return bound

    def register_mapping(self, client: ClientState, msg: Message, now: float) -> None:
        """SET_VOCAB: store a client's mapping (content-addressed) after dropping the registrations it
        releases; answer VOCAB_OK with its digest."""
        header = SetVocab.from_json(msg.header)
        if not self.pin_target(client, msg, header.fingerprint):
            return
        self.vocab.release(client, msg.service, header.release or [])
        known = self.services.get(msg.service)
        try:
            digest = self.vocab.digest(msg.payload, known.vocab_size if known else None)
        except BadMapping as e:
            self.send_error(client.identity, msg.request_id, ErrorCode.BAD_REQUEST, str(e))
            return
        service = self.service(msg.service, now)
        if digest not in service.mappings:
            if not self._can_hold(client, msg.request_id, sum(len(memoryview(f)) for f in msg.payload)):
                return
            self.vocab.store(service, digest, msg.payload)
        self.vocab.keep(client, msg.service, digest)
        self._trim_mappings()
        self.to_client(client.identity, control(
            CLIENT_TAG, ClientCommand.VOCAB_OK.value, msg.service, msg.request_id, VocabOk(digest)))

    def _trim_mappings(self) -> None:
        self.vocab.trim(self.services.values(), self.clients.values(), self.requests)

    def _can_hold(self, client: ClientState, request_id: bytes, size: int) -> bool:
        """Room for ``size`` more payload bytes; if not, the client is told to back off (it retries)."""
        why = self.room(client.identity, size)
        if why is not None:
            self.send_error(client.identity, request_id, ErrorCode.UNAVAILABLE, why)
        return why is None

    def room(self, identity: bytes, size: int) -> str | None:
        """Why ``size`` more payload bytes from the client ``identity`` cannot be held now (None: they can):
        all clients together hold at most --max-held-bytes, one at most its share of it."""
        held = self.requests.held + self.vocab.held_bytes + self.reserved(None)
        if held + size > self.max_held_bytes:
            return (f"the broker holds {held} bytes of requests; {size} more would pass its limit of "
                    f"{self.max_held_bytes} (--max-held-bytes)")
        client = self.clients.get(identity)
        mine = self.reserved(identity) + sum(self.requests[r].size for r in (client.requests if client else ())
                                             if r in self.requests)
        if mine + size > self.max_client_bytes:
            return (f"this client already has {mine} bytes of requests at the broker; {size} more would pass its "
                    f"share of {self.max_client_bytes} (--client-held-share of --max-held-bytes)")
        return None

    def pin_target(self, client: ClientState, msg: Message, fingerprint: str | None) -> bool:
        """Note the target ``fingerprint`` a client's message names (the one it set up with); False, after
        answering ``target_changed``, if the service's workers now serve another."""
        if fingerprint is None:
            return True
        service = self.services.get(msg.service)
        serving = self.workers[service.workers[0]].info.get("fingerprint") if service and service.workers else None
        if serving is not None and serving != fingerprint:
            self.send_error(client.identity, msg.request_id, ErrorCode.TARGET_CHANGED,
                            f"service {msg.service!r} now serves target fingerprint {serving}, but this client set "
                            f"up with {fingerprint}: start a new client to use the new target")
            return False
        client.fingerprints[msg.service] = fingerprint
        return True

    def disconnect(self, client: ClientState, msg: Message, now: float) -> None:
        """DISCONNECT: the client asks to be forgotten."""
        self.delete_client(client.identity)

    def delete_client(self, identity: bytes) -> None:
        """Forget a client: drop what it queued; what runs finishes and is discarded."""
        client = self.clients.pop(identity, None)
        if client is None:
            return
        self.bindings.unbind_client(identity, "client gone")
        freed = set()
        for request_id in client.requests:
            request = self.requests.pop(request_id, None)
            if request is not None and request.worker is not None:
                # Its worker finishes and discards the reply, but the slot is free
                # now: a vanished client must not hold a worker for the reply timeout.
                worker = self.workers.get(request.worker)
                if worker is not None:
                    worker.inflight.discard(request_id)
                    freed.add(worker.service)
        for service in self.services.values():
            service.queues.pop(identity, None)
        self.metrics.clients.set(len(self.clients))
        event(log, logging.INFO, "broker.client_gone", client=identity.hex()[:12])
        for name in freed:
            self.dispatch(self.services[name])

    # ------------------------------------------------------------------ workers

    def worker_ready(self, identity: bytes, msg: Message, now: float) -> None:
        """READY: register the worker, replacing its earlier registration if it had one."""
        worker = self.workers.get(identity)
        if worker is not None:
            self.delete_worker(worker, now, reason="re-registered", died=False)
        self.register_worker(identity, msg, now)

    def worker_seen(self, identity: bytes, now: float) -> WorkerState | None:
        """The registered worker that sent a message now, its expiry extended; None if unknown."""
        worker = self.workers.get(identity)
        if worker is not None:
            worker.expiry = now + self.expiry_window
        return worker

    def register_worker(self, identity: bytes, msg: Message, now: float) -> None:
        ready = Ready.from_json(msg.header)
        info, capacity = ready.target_info, ready.capacity
        if capacity > MAX_WORKER_CAPACITY:
            event(log, logging.WARNING, "broker.capacity_capped", worker=identity.hex()[:12], claimed=capacity,
                  used=MAX_WORKER_CAPACITY)
            capacity = MAX_WORKER_CAPACITY
        try:
            target = TargetInfo.from_dict(info)  # clients check it at setup: refuse junk here
        except (ValueError, TypeError) as e:
            raise ProtocolError(f"READY with invalid target_info: {e}") from None
        if len(encode_header(info)) > MAX_TARGET_INFO_BYTES:  # every STATUS page entry stays small
            raise ProtocolError(f"READY with a target_info over {MAX_TARGET_INFO_BYTES} bytes")
        service = self.service(msg.service, now)
        conflict = self.target_conflict(service, target)
        if conflict is not None:
            self.refuse_worker(identity, service, conflict)
            return
        worker = WorkerState(identity, msg.service, info, capacity, now + self.expiry_window, time.time(),
                             idle_since=now, max_message_bytes=ready.max_message_bytes)
        self.workers[identity] = worker
        service.workers.append(identity)
        self._remember_served(msg.service)
        if service.vocab_size is None and isinstance(info.get("vocab_size"), int):
            service.vocab_size = info["vocab_size"]
        self.metrics.workers.labels(service=msg.service).set(len(service.workers))
        event(log, logging.INFO, "broker.worker_ready", worker=worker.name, service=msg.service,
              engine=info.get("engine"), capacity=capacity)
        self.status_stale = True
        self.dispatch(service)

    def _remember_served(self, name: str) -> None:
        self.served[name] = None
        self.served.move_to_end(name)
        while len(self.served) > MAX_SERVED_NAMES:
            self.served.popitem(last=False)

    def target_conflict(self, service: ServiceState, info: TargetInfo) -> str | None:
        """Why a worker serving ``info`` may not join ``service``, or None.

        The service's target is what its workers serve (they must agree on everything but the engine)
        and, while the service has no worker, the fingerprint every known client of it set up with:
        the target cannot change under a client (docs/failure-semantics.md)."""
        if service.workers:
            first = self.workers[service.workers[0]]
            diff = TargetInfo.from_dict(first.info).mismatches(info, ignore=("engine",))
            if not diff:
                return None
            fields = "; ".join(f"{k}: serving={a!r} new={b!r}" for k, (a, b) in diff.items())
            return f"service {service.name!r} is served by another target (worker {first.name}): {fields}"
        pinned = sorted({c.fingerprints[service.name] for c in self.clients.values()
                         if c.fingerprints.get(service.name, info.fingerprint) != info.fingerprint})
        if not pinned:
            return None
        users = sum(1 for c in self.clients.values() if c.fingerprints.get(service.name) in pinned)
        return (f"{users} connected client(s) of service {service.name!r} set up with target fingerprint "
                f"{', '.join(pinned)}; this worker serves {info.fingerprint}")

    def refuse_worker(self, identity: bytes, service: ServiceState, reason: str) -> None:
        message = (f"{reason}. Serve this checkpoint under another --service, or stop every worker and client "
                   f"of {service.name!r} first")
        self.metrics.refused_workers.labels(service=service.name).inc()
        event(log, logging.ERROR, "broker.worker_refused", worker=identity.hex()[:12], service=service.name,
              reason=message)
        self.to_worker(identity, control(WORKER_TAG, WorkerCommand.REFUSED.value, service.name,
                                         header=Refused(error=message)))

    def worker_left(self, worker: WorkerState, msg: Message, now: float) -> None:
        """LEAVE. With ``drain`` (the worker was told to stop): it gets nothing more, its binding ends, and it
        finishes or hands back (DONE returned) what it holds before it LEAVEs for good. Otherwise it goes
        now (its engine died, or it stopped): what it still holds goes elsewhere. The request a dead engine
        was running got engine_dead already; the rest were never run: no suspects."""
        leave = Leave.from_json(msg.header)
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
        self.workers.pop(worker.identity, None)
        service = self.services[worker.service]
        if worker.identity in service.workers:
            service.workers.remove(worker.identity)
        for request_id in worker.inflight:
            request = self.requests.get(request_id)
            if request is None or request.worker != worker.identity:  # gone, or taken from it at its deadline
                continue
            self._orphaned(service, worker, request, reason, died)
        worker.inflight.clear()
        self.bindings.unbind(worker, reason, notify=True)
        self.metrics.workers.labels(service=worker.service).set(len(service.workers))
        event(log, logging.WARNING, "broker.worker_gone", worker=worker.name, service=worker.service, reason=reason)
        self.status_stale = True
        self.dispatch(service)

    def _orphaned(self, service: ServiceState, worker: WorkerState, request: Request, reason: str,
                  died: bool) -> None:
        """``request`` was on ``worker`` as it went: back to the front of its queue, failed, or dropped."""
        request.worker = None
        if request.header.bound is not None:
            # Its binding died with the worker: the client re-sends it as frames.
            self._forget_request(request)
            self.send_error(request.client, request.request_id, ErrorCode.UNAVAILABLE,
                            f"bound worker {worker.name} is gone ({reason})", unbound=True)
        elif died and self._killed_by(request, worker):
            return
        elif request.client in self.clients:
            service.queues.setdefault(request.client, collections.deque()).appendleft(request.request_id)
            self.metrics.redispatched.inc()
        else:
            del self.requests[request.request_id]

    def _killed_by(self, request: Request, worker: WorkerState) -> bool:
        """Count ``worker``'s death against ``request``; True if that failed the request for good."""
        request.killed.append(worker.name)
        if len(request.killed) < self.max_request_deaths:
            return False  # a suspect from now on: dispatched alone (see _eligible)
        self._forget_request(request)
        error = (f"request {request.request_id.hex()} was on {len(request.killed)} workers of "
                 f"{request.service!r} as they died ({', '.join(request.killed)}); it is not sent to another, "
                 f"as its input may crash every worker (broker --max-request-deaths {self.max_request_deaths})")
        self.killers[request.request_id] = error
        while len(self.killers) > MAX_KILLER_IDS:
            self.killers.popitem(last=False)
        self.metrics.killer_requests.inc()
        event(log, logging.ERROR, "broker.request_killed_workers", request=request.request_id.hex(),
              service=request.service, workers=",".join(request.killed))
        if request.client in self.clients:
            self.send_error(request.client, request.request_id, ErrorCode.KILLED_WORKERS, error)
        return True

    def complete(self, worker: WorkerState, msg: Message, now: float) -> None:
        """DONE: the worker answered a request (or failed to deliver it); its slot is free again."""
        done = Done.from_json(msg.header)
        worker.inflight.discard(msg.request_id)
        worker.idle_since = now
        worker.leaving = worker.leaving or done.status == "engine_dead"
        request = self.requests.get(msg.request_id)
        if done.status == "returned" and request is not None and request.worker == worker.identity:
            # Handed back unrun by a draining worker: to the front of its queue, for another worker now.
            self._orphaned(self.services[worker.service], worker, request, "returned by its worker", died=False)
        elif request is not None and request.worker == worker.identity:
            del self.requests[msg.request_id]
            client = self.clients.get(request.client)
            if client is not None:
                client.requests.discard(msg.request_id)
            status = done.status if done.status in DONE_STATUSES else "error"
            self.metrics.completed.labels(service=worker.service, status=status).inc()
            if status == "undeliverable" and client is not None:
                # The worker dropped the reply at once (its slot is free): the client retries now,
                # instead of waiting out its timeout.
                self.send_error(request.client, msg.request_id, ErrorCode.UNAVAILABLE,
                                f"worker {worker.name} could not deliver the reply to "
                                f"{request.header.reply_to}: {'not reading' if done.error is None else done.error}")
            if status == "ok":
                self._count_ok(worker, request, done, now)
        self.dispatch(self.services[worker.service])

    def _count_ok(self, worker: WorkerState, request: Request, done: Done, now: float) -> None:
        worker.completed += 1
        self.metrics.tokens.labels(service=worker.service).inc(done.tokens or 0)
        self.metrics.reply_bytes.labels(service=worker.service).inc(done.nbytes or 0)
        self.metrics.latency.labels(service=worker.service).observe(now - request.enqueued_at)

    # ------------------------------------------------------------------ dispatch

    def service(self, name: str, now: float) -> ServiceState:
        service = self.services.get(name)
        if service is None:
            service = self.services[name] = ServiceState(name, now)
        return service

    def dispatch(self, service: ServiceState) -> None:
        """Hand queued requests to free workers: round-robin over clients,
        least-loaded worker first (ties go to the longest idle)."""
        while service.queues:
            free = [w for w in (self.workers[i] for i in service.workers)
                    if w.free > 0 and w.bound_to is None and not self._holds_suspect(w)]
            if not free:
                return
            picked = self._next_request(service, free)
            if picked is None:
                return
            request, eligible = picked
            worker = min(eligible, key=lambda w: (len(w.inflight) / w.capacity, w.idle_since))
            self.send_request(service, worker, request)

    def _next_request(self, service: ServiceState, candidates: list) -> tuple[Request, list] | None:
        """The first queued request (clients in round-robin order) some candidate may take, taken off its
        queue, with those candidates; None if none may. A request retried after a digest mismatch names
        the worker that produced it (``avoid``), which takes it only when no other unbound worker exists."""
        for client_id, queue in list(service.queues.items()):
            for request_id in list(queue):
                request = self.requests.get(request_id)
                if request is None:  # forgotten meanwhile (its client left, or it timed out)
                    queue.remove(request_id)
                    continue
                eligible = self._eligible(service, request, candidates)
                if not eligible:
                    continue
                queue.remove(request_id)
                if queue:
                    service.queues.move_to_end(client_id)
                else:
                    del service.queues[client_id]
                return request, eligible
            if not queue:
                del service.queues[client_id]
        return None

    def _eligible(self, service: ServiceState, request: Request, candidates: list) -> list:
        """The candidates that may take ``request``. A suspect (it was on a worker that died) goes only to
        an idle worker, which then takes nothing else until it is done (``_holds_suspect``): if that
        worker dies too, the death is the suspect's alone. Never a worker that held it past its deadline."""
        candidates = [w for w in candidates if w.identity not in request.missed]
        if request.killed:
            candidates = [w for w in candidates if not w.inflight]
        avoid = request.header.avoid
        if avoid is None or not any(self.workers[w].name != avoid and self.workers[w].bound_to is None
                                    for w in service.workers):
            return candidates
        return [w for w in candidates if w.name != avoid]

    def _holds_suspect(self, worker: WorkerState) -> bool:
        return any(self.requests[r].killed for r in worker.inflight if r in self.requests)

    def send_request(self, service: ServiceState, worker: WorkerState, request: Request) -> None:
        """Send ``request`` to ``worker``, preceded by the vocab mapping it names if the worker lacks it."""
        vocab = request.header.vocab
        if vocab is not None:
            if vocab not in worker.mappings and vocab not in service.mappings:
                self._forget_request(request)
                self.send_error(request.client, request.request_id, ErrorCode.BAD_REQUEST,
                                f"vocab mapping {vocab!r} is no longer registered", unknown_vocab=True)
                return
            set_vocab = self.vocab.install(service, worker, vocab, self.requests)
            if set_vocab is not None:
                self.to_worker(worker.identity, set_vocab)
        header = dataclasses.replace(request.header, client=request.client.hex())
        frames = control(WORKER_TAG, WorkerCommand.REQUEST.value, service.name, request.request_id, header,
                         request.payload)
        if not self.to_worker(worker.identity, frames):
            service.queues.setdefault(request.client, collections.deque()).appendleft(request.request_id)
            self.delete_worker(worker, time.monotonic(), reason="unreachable", died=True)
            return
        request.worker = worker.identity
        request.dispatches += 1
        request.dispatched_at = time.monotonic()
        worker.inflight.add(request.request_id)

    def _forget_request(self, request: Request) -> None:
        self.requests.pop(request.request_id, None)
        client = self.clients.get(request.client)
        if client is not None:
            client.requests.discard(request.request_id)

    # ------------------------------------------------------------------ heartbeat and purge

    def heartbeat(self, now: float) -> None:
        beat = control(WORKER_TAG, WorkerCommand.HEARTBEAT.value)
        for worker in list(self.workers.values()):
            self.to_worker(worker.identity, beat)
        beat = control(CLIENT_TAG, ClientCommand.HEARTBEAT.value, header=BrokerHeartbeat(self.instance_id))
        for identity in list(self.clients):
            if not self.to_client(identity, beat):
                self.delete_client(identity)

    def purge(self, now: float) -> None:
        """Expire silent workers and clients, and requests past their deadline."""
        for worker in [w for w in self.workers.values() if w.expiry < now]:
            self.metrics.worker_deaths.inc()
            self.delete_worker(worker, now, reason="heartbeat expired", died=True)
        for identity in [c.identity for c in self.clients.values() if c.expiry < now]:
            self.delete_client(identity)
        for request in [r for r in self.requests.values()
                        if r.worker is not None and now > r.dispatched_at + float(r.header.timeout)]:
            self.deadline_missed(request)
        for service in self.services.values():
            self._expire_queued(service, now)
        self._trim_mappings()
        self._forget_idle_services(now)
        for service in self.services.values():
            self.metrics.queue_depth.labels(service=service.name).set(service.queue_depth())
        self.metrics.inflight.set(sum(1 for r in self.requests.values() if r.worker is not None))

    def _expire_queued(self, service: ServiceState, now: float) -> None:
        """Fail the queued requests of ``service`` past their deadline, or all of them once the service
        is unknown (no worker ever served it)."""
        unknown = self._unknown(service.name, now)
        for client_id, queue in list(service.queues.items()):
            for request_id in list(queue):
                request = self.requests.get(request_id)
                if request is None:
                    queue.remove(request_id)
                    continue
                if request.deadline < now or unknown:
                    queue.remove(request_id)
                    self._forget_request(request)
                    if unknown:
                        self.send_error(client_id, request_id, ErrorCode.UNKNOWN_SERVICE,
                                        self._unknown_message(service.name))
                    else:
                        self.send_error(client_id, request_id, ErrorCode.TIMEOUT,
                                        f"no worker of {service.name!r} took the request before its deadline")
            if not queue:
                service.queues.pop(client_id, None)

    def deadline_missed(self, request: Request) -> None:
        """Its worker held it past its timeout: dead for this request. It goes to another worker with a
        fresh deadline (the slot stays taken until the worker answers; a late DONE is ignored, a late
        reply the client drops as a duplicate)."""
        held_by = request.worker
        if held_by is None:  # only a dispatched request can miss its deadline; purge() picks only those
            return
        worker = self.workers.get(held_by)
        event(log, logging.WARNING, "broker.deadline_missed", request=request.request_id.hex()[:12],
              worker=worker.name if worker else held_by.hex()[:12])
        request.missed.add(held_by)
        request.worker = None
        if request.header.bound is not None:  # its binding is no use: the client re-sends it as frames
            self._forget_request(request)
            name = worker.name if worker else "?"
            self.send_error(request.client, request.request_id, ErrorCode.UNAVAILABLE,
                            f"bound worker {name} missed the request's deadline", unbound=True)
            return
        request.deadline = max(request.deadline, time.monotonic() + float(request.header.timeout))
        service = self.services[request.service]
        service.queues.setdefault(request.client, collections.deque()).appendleft(request.request_id)
        self.metrics.redispatched.inc()
        self.dispatch(service)

    def _forget_idle_services(self, now: float) -> None:
        """Drop services with no worker, no request and no client mapping for IDLE_SERVICE_GRACE, so
        names a peer once used do not pile up (``served`` still remembers those that had workers)."""
        held = {r.service for r in self.requests.values()}
        held.update(name for client in self.clients.values() for name, _ in client.vocab)
        for name, service in list(self.services.items()):
            if service.workers or service.queues or name in held:
                service.idle_since = None
            elif service.idle_since is None:
                service.idle_since = now
            elif now - service.idle_since > IDLE_SERVICE_GRACE:
                del self.services[name]
                self.metrics.forget_service(name, DONE_STATUSES)
                self.status_stale = True

    def _unknown(self, name: str, now: float) -> bool:
        """No worker ever served it, and the grace since its first use (workers still loading) is over."""
        service = self.services.get(name)
        return name not in self.served and service is not None and now - service.created_at > UNKNOWN_SERVICE_GRACE

    def _unknown_message(self, name: str) -> str:
        known = sorted(s for s, st in self.services.items() if st.workers)
        return f"unknown service {name!r}: no worker serves it; services with workers: {known}"
