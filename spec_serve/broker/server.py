"""The broker: a Majordomo-style ROUTER/ROUTER load balancer for supervision.

Clients talk to the frontend, workers to the backend. The broker queues
requests per service and per client, dispatches them fairly (round-robin over
clients) to the least-loaded worker, keeps an in-flight table and re-dispatches
a dead worker's requests. Bulk reply bytes go from worker to client directly;
the broker only sees a small DONE. Method names follow the Majordomo spec:
``process_client``, ``process_worker``, ``dispatch``, ``purge``, ``heartbeat``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import logging
import threading
import time
import uuid
from typing import Any

import zmq

from spec_serve.protocol import wire
from spec_serve.supervision.contract import TargetInfo, validate_vocab_mapping
from spec_serve.transport.ingress import Ingress
from spec_serve.telemetry.logs import Throttle, event
from spec_serve.telemetry.metrics import BrokerMetrics
from spec_serve.protocol.commands import (
    CLIENT_TAG,
    CONTROL_SLACK_BYTES,
    HEARTBEAT_INTERVAL,
    HEARTBEAT_LIVENESS,
    IDLE_SERVICE_GRACE,
    MAX_HEADER_BYTES,
    MAX_HEADER_BYTES,
    UNKNOWN_SERVICE_GRACE,
    WORKER_TAG,
    ClientCommand,
    ErrorCode,
    Message,
    ProtocolError,
    WorkerCommand,
    control,
    encode_header,
    parse_control,
)
from spec_serve.transport.sockets import (
    DEFAULT_MAX_FRAME_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    KeyPolicy,
    Security,
    bound_endpoint,
    make_socket,
)

log = logging.getLogger("spec_serve.broker")

# Requests one client may have queued or in flight at the broker; beyond this
# it is told to back off. Bounds broker memory whatever clients do.
MAX_REQUESTS_PER_CLIENT = 256
# Draft-vocab mappings one client keeps registered (per service and in all); an honest client needs its
# current one plus those its pending requests name. Beyond this its oldest registration is dropped.
MAX_MAPPINGS_PER_CLIENT = 16
# Mappings the broker keeps on one worker. The broker decides which a worker drops (SET_VOCAB "evict"),
# so its record of what a worker holds is exact; one named by a request on that worker is never evicted.
MAX_WORKER_MAPPINGS = 16
# Service names that ever had a worker, remembered after the service is forgotten (see _unknown).
MAX_SERVED_NAMES = 4096
# A worker's target info as sent in READY; real ones are a few hundred bytes.
MAX_TARGET_INFO_BYTES = 8 << 10
# Entries one STATUS page carries, in encoded bytes: a page stays far below the peers' header limit.
STATUS_PAGE_BYTES = MAX_HEADER_BYTES // 2
# What a worker's DONE may say; anything else counts as "error".
DONE_STATUSES = ("ok", "error", "undeliverable")
# Ids of requests failed for killing workers, refused if they come back (a retry that crossed the error).
MAX_KILLER_IDS = 1024
# Messages drained from one socket before looking at the other (fairness).
DRAIN_BATCH = 64
# Request and vocab-mapping payload bytes the broker holds at once (queued, in flight, stored);
# past it a new request is told to back off (unavailable, retried), a larger one is refused.
DEFAULT_MAX_HELD_BYTES = 1 << 30
# Workers send the broker control messages only: no frame above a header, little per connection.
BACKEND_FRAME_BYTES = MAX_HEADER_BYTES + 4096
BACKEND_CONNECTION_BYTES = 1 << 20
BACKEND_TOTAL_BYTES = 64 << 20
# Requests one worker may hold at once, whatever it claims: a claim of 10^6 must not draw the queue.
MAX_WORKER_CAPACITY = 64
# A peer on the wrong port is answered every time, but logged once per this many seconds.
WRONG_PORT_LOG_INTERVAL_S = 60.0


class BindError(OSError):
    """The broker cannot bind one of its endpoints; ``role`` says which ("frontend" or "backend")."""

    def __init__(self, role: str, endpoint: str, reason: str):
        super().__init__(f"cannot bind the {role} {endpoint}: {reason}")
        self.role, self.endpoint, self.reason = role, endpoint, reason


@contextlib.contextmanager
def _binding(role: str, endpoint: str):
    """Turn a failed bind of ``endpoint`` into a BindError that names the role and the likely cause."""
    try:
        yield
    except zmq.ZMQError as e:
        reason = e.strerror
        if e.errno == zmq.EADDRINUSE:
            reason = "address already in use (another broker running? choose a free port)"
        raise BindError(role, endpoint, reason) from e


@dataclasses.dataclass
class WorkerState:
    identity: bytes
    service: str
    info: dict[str, Any]
    capacity: int
    expiry: float
    registered_at: float
    inflight: set = dataclasses.field(default_factory=set)
    # digests this worker holds, least recently used first (it drops only what SET_VOCAB evicts)
    mappings: "collections.OrderedDict[str, None]" = dataclasses.field(default_factory=collections.OrderedDict)
    max_message_bytes: int | None = None
    bound_to: bytes | None = None
    bind_address: str | None = None
    bind_prefix: str | None = None  # the binding's pair-group prefix (unique per binding)
    bind_request: bytes = b""  # the client's BIND request id
    idle_since: float = 0.0
    completed: int = 0
    leaving: bool = False  # its engine died: no more requests; LEAVE follows its last answers

    @property
    def name(self) -> str:
        return self.identity.hex()[:12]

    @property
    def free(self) -> int:
        return 0 if self.leaving else self.capacity - len(self.inflight)


@dataclasses.dataclass
class Request:
    request_id: bytes
    client: bytes
    service: str
    header: dict[str, Any]
    payload: list
    deadline: float
    enqueued_at: float
    size: int = 0  # payload bytes, counted in the broker's held bytes
    worker: bytes | None = None
    dispatches: int = 0
    killed: list = dataclasses.field(default_factory=list)  # workers that died while it was on them
    dispatched_at: float = 0.0
    missed: set = dataclasses.field(default_factory=set)  # workers that held it past its timeout


class RequestTable(dict):
    """request id -> Request that keeps ``held``, the sum of its requests' payload bytes."""

    held = 0

    def __setitem__(self, request_id: bytes, request: Request) -> None:
        self.pop(request_id, None)
        super().__setitem__(request_id, request)
        self.held += request.size

    def __delitem__(self, request_id: bytes) -> None:
        self.held -= self[request_id].size
        super().__delitem__(request_id)

    def pop(self, request_id: bytes, *default):
        if request_id in self:
            self.held -= self[request_id].size
        return super().pop(request_id, *default)


@dataclasses.dataclass
class ClientState:
    identity: bytes
    expiry: float
    requests: set = dataclasses.field(default_factory=set)
    # service -> target fingerprint this client set up with (from its requests); a worker serving
    # another target may not join that service while the client is known.
    fingerprints: dict = dataclasses.field(default_factory=dict)
    # (service, digest) of the mappings it registered and has not released, oldest first
    vocab: "collections.OrderedDict[tuple[str, str], None]" = dataclasses.field(
        default_factory=collections.OrderedDict)


@dataclasses.dataclass
class ServiceState:
    name: str
    created_at: float
    workers: list = dataclasses.field(default_factory=list)
    # client identity -> queued request ids; rotated for fairness.
    queues: "collections.OrderedDict[bytes, collections.deque]" = dataclasses.field(
        default_factory=collections.OrderedDict
    )
    # digest -> payload frames as bytes; only live mappings (see Broker._trim_mappings)
    mappings: dict = dataclasses.field(default_factory=dict)
    vocab_size: int | None = None
    idle_since: float | None = None  # no workers, clients or requests since then

    def queue_depth(self) -> int:
        return sum(len(q) for q in self.queues.values())


class Broker:
    """Owns the two ROUTER sockets and all routing state; single-threaded loop."""

    def __init__(
        self,
        frontend: str = "tcp://*:5555",
        backend: str = "tcp://*:5556",
        *,
        security: Security | None = None,
        heartbeat_interval: float = HEARTBEAT_INTERVAL,
        liveness: int = HEARTBEAT_LIVENESS,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_request_deaths: int = 2,
        max_held_bytes: int = DEFAULT_MAX_HELD_BYTES,
        context: zmq.Context | None = None,
    ):
        if max_request_deaths < 1:
            raise ValueError("max_request_deaths must be >= 1")
        self.ctx = context or zmq.Context.instance()
        self.instance_id = uuid.uuid4().hex
        self.heartbeat_interval = heartbeat_interval
        self.liveness = liveness
        # A request must fit what the broker may hold.
        self.max_message_bytes = min(max_message_bytes, max_held_bytes)
        self.max_held_bytes = max_held_bytes
        # A request on this many workers as they died fails (killed_workers) instead of going to another.
        self.max_request_deaths = max_request_deaths
        # libzmq drops a peer that sends a frame over this, before allocating it.
        frame_limit = min(DEFAULT_MAX_FRAME_BYTES, self.max_message_bytes + (1 << 16))
        # With CURVE, clients' keys on the frontend and workers' keys on the backend, never one set for both
        # (an admitted client key must not register as a worker).
        if security is not None and (security.client_keys_dir is None or security.worker_keys_dir is None):
            raise ValueError("a CURVE broker needs client_keys_dir and worker_keys_dir (separate key sets)")
        self.client_keys = KeyPolicy(security.client_keys_dir) if security else None
        self.worker_keys = KeyPolicy(security.worker_keys_dir) if security else None
        self.frontend = make_socket(self.ctx, zmq.ROUTER, security=security, admit=self.client_keys,
                                    max_frame_bytes=frame_limit)
        self.backend = make_socket(self.ctx, zmq.ROUTER, security=security, admit=self.worker_keys,
                                   max_frame_bytes=BACKEND_FRAME_BYTES)
        # What a peer can make libzmq hold before a message is whole (ingress.py); the sockets bind
        # once watched. A request up to twice the limit still gets its error reply.
        front = None
        try:
            with _binding("frontend", frontend):
                front = Ingress(self.frontend, "broker.frontend", bind=frontend, router=True,
                                per_connection=2 * self.max_message_bytes + CONTROL_SLACK_BYTES,
                                total=max_held_bytes + CONTROL_SLACK_BYTES)
            with _binding("backend", backend):
                back = Ingress(self.backend, "broker.backend", bind=backend, router=True,
                               per_connection=BACKEND_CONNECTION_BYTES, total=BACKEND_TOTAL_BYTES)
        except BindError:  # the one that failed closed its socket; close the rest
            if front is not None:
                front.close()
            self.frontend.close(0)
            self.backend.close(0)
            raise
        self.ingress = {self.frontend: front, self.backend: back}
        # A reconnecting peer keeps its identity and takes over its old route.
        for sock in (self.frontend, self.backend):
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.frontend_endpoint = bound_endpoint(self.frontend)
        self.backend_endpoint = bound_endpoint(self.backend)
        self.workers: dict[bytes, WorkerState] = {}
        self.services: dict[str, ServiceState] = {}
        self.clients: dict[bytes, ClientState] = {}
        self.requests = RequestTable()
        self.mapping_bytes = 0  # payload bytes of the vocab mappings stored, all services
        self.served: "collections.OrderedDict[str, None]" = collections.OrderedDict()  # names that had workers
        self.killers: "collections.OrderedDict[bytes, str]" = collections.OrderedDict()  # request id -> error
        self.metrics = BrokerMetrics()
        self.started_at = time.time()
        self._snapshot: dict[str, Any] = {}
        self._snapshot_lock = threading.Lock()
        self._snapshot_stale = False  # rebuilt once per loop turn, not once per message (O(workers) each)
        self._stop = threading.Event()
        self._wrong_port_log = Throttle(WRONG_PORT_LOG_INTERVAL_S)

    # ------------------------------------------------------------------ loop

    def run(self) -> None:
        """Serve until ``stop()``; never raises on a peer's bad message."""
        poller = zmq.Poller()
        poller.register(self.frontend, zmq.POLLIN)
        poller.register(self.backend, zmq.POLLIN)
        next_tick = time.monotonic()
        tick = min(self.heartbeat_interval, 0.25)
        event(log, logging.INFO, "broker.start", frontend=self.frontend_endpoint, backend=self.backend_endpoint)
        self.update_snapshot()
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(tick * 1000))
                if self.backend in events:
                    self._drain(self.backend, self.process_worker)
                if self.frontend in events:
                    self._drain(self.frontend, self.process_client)
                now = time.monotonic()
                if now >= next_tick:
                    self.purge(now)
                    self.heartbeat(now)
                    self._snapshot_stale = True
                    next_tick = now + self.heartbeat_interval
                if self._snapshot_stale:
                    self.update_snapshot()
        finally:
            for ingress in self.ingress.values():
                ingress.close()
            self.frontend.close(0)
            self.backend.close(0)
            event(log, logging.INFO, "broker.stop")

    def stop(self) -> None:
        self._stop.set()

    def _drain(self, sock: zmq.Socket, handler) -> None:
        for _ in range(DRAIN_BATCH):
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.ingress[sock].delivered(frames)
            identity, body = frames[0].bytes, frames[1:]
            if self._wrong_port(sock, identity, body):
                continue
            try:
                handler(identity, body)
            except ProtocolError as e:
                self.metrics.bad_messages.inc()
                event(log, logging.WARNING, "broker.bad_message", peer=identity.hex()[:12], error=e)
                if sock is self.frontend:
                    self.send_error(identity, e.request_id, ErrorCode.BAD_REQUEST, str(e))
            except Exception as e:  # a bug must not take the broker down
                self.metrics.bad_messages.inc()
                log.exception("broker.handler_failed peer=%s error=%s", identity.hex()[:12], e)

    def _wrong_port(self, sock: zmq.Socket, identity: bytes, frames: list) -> bool:
        """A client on the workers' port, or a worker on the clients' port: tell it which port it
        reached (it fails fast with that) and log it, rate-limited. True if it was one."""
        tag = frames[0].bytes if frames else b""
        clients, workers = _port_name(self.frontend_endpoint), _port_name(self.backend_endpoint)
        if sock is self.backend and tag == CLIENT_TAG:
            port, tag, command = "backend", CLIENT_TAG, ClientCommand.ERROR.value
            error = (f"this is the spec-serve broker's worker port ({workers}); clients connect to its "
                     f"client port ({clients}, --frontend)")
        elif sock is self.frontend and tag == WORKER_TAG:
            port, tag, command = "frontend", WORKER_TAG, WorkerCommand.REFUSED.value
            error = (f"this is the spec-serve broker's client port ({clients}); workers connect to its "
                     f"worker port ({workers}, --backend)")
        else:
            return False
        self.metrics.bad_messages.inc()
        self.metrics.errors.labels(code=ErrorCode.WRONG_PORT.value).inc()
        self._send(sock, identity, control(tag, command, "", b"", {"code": ErrorCode.WRONG_PORT.value,
                                                                     "error": error}))
        held = self._wrong_port_log.ready(port, time.monotonic())
        if held is not None:
            event(log, logging.WARNING, "broker.wrong_port", port=port, peer=identity.hex()[:12],
                  peer_type="client" if tag == CLIENT_TAG else "worker", similar_since_last=held)
        return True

    # --------------------------------------------------------------- clients

    def process_client(self, identity: bytes, frames: list) -> None:
        msg = parse_control(frames, CLIENT_TAG, ClientCommand)
        now = time.monotonic()
        client = self.clients.get(identity)
        if client is None:
            client = self.clients[identity] = ClientState(identity, now)
            self.metrics.clients.set(len(self.clients))
        client.expiry = now + self.heartbeat_interval * self.liveness
        try:
            self._client_command(client, msg, now)
        except ProtocolError as e:  # name the request, so its sender fails it at once
            raise ProtocolError(str(e), e.request_id or msg.request_id) from None

    def _client_command(self, client: ClientState, msg: Message, now: float) -> None:
        identity = client.identity
        command = ClientCommand(msg.command)
        if command is ClientCommand.REQUEST:
            self.enqueue(client, msg, now)
        elif command is ClientCommand.SET_VOCAB:
            self.register_mapping(client, msg)
        elif command is ClientCommand.STATUS:
            self._send(self.frontend, identity, control(
                CLIENT_TAG, ClientCommand.STATUS.value, msg.service, msg.request_id, self.status_page(msg.header)))
        elif command is ClientCommand.DISCONNECT:
            self.delete_client(identity)
        elif command is ClientCommand.BIND:
            self.bind(client, msg)
        elif command is ClientCommand.RELEASE:
            prefix = msg.header.get("prefix")
            for worker in [w for w in self.workers.values() if w.bound_to == identity]:
                if prefix is None or prefix == worker.bind_prefix:
                    self.unbind(worker, "released by its client")
        elif command is ClientCommand.HEARTBEAT:
            pass
        else:
            raise ProtocolError(f"clients may not send {command.name}")

    def enqueue(self, client: ClientState, msg: Message, now: float) -> None:
        if not msg.request_id:
            raise ProtocolError("REQUEST without a request id")
        timeout = _request_timeout(msg.header)
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
        if len(client.requests) >= MAX_REQUESTS_PER_CLIENT:
            self.send_error(client.identity, msg.request_id, ErrorCode.UNAVAILABLE,
                            f"more than {MAX_REQUESTS_PER_CLIENT} requests outstanding for this client")
            return
        if not _valid_endpoint(msg.header.get("reply_to")):
            raise ProtocolError("REQUEST header needs reply_to, a tcp://host:port or ipc:// endpoint")
        if not isinstance(msg.header.get("vocab", ""), str):
            raise ProtocolError("REQUEST header 'vocab' must be a digest string")
        if not isinstance(msg.header.get("avoid", ""), str):
            raise ProtocolError("REQUEST header 'avoid' must be a worker id string")
        if not self.pin_target(client, msg):
            return
        size = sum(len(memoryview(f)) for f in msg.payload)
        if size > self.max_message_bytes:
            self.send_error(client.identity, msg.request_id, ErrorCode.BAD_REQUEST,
                            f"request of {size} bytes exceeds the limit of {self.max_message_bytes}")
            return
        if not self._can_hold(client, msg.request_id, size):
            return
        vocab = msg.header.get("vocab")
        service = self.services.get(msg.service)
        if vocab is not None and (service is None or vocab not in service.mappings):
            self.send_error(client.identity, msg.request_id, ErrorCode.BAD_REQUEST,
                            f"unknown vocab mapping {vocab!r}: call set_vocab_mapping first", unknown_vocab=True)
            return
        if self._unknown(msg.service, now):
            self.send_error(client.identity, msg.request_id, ErrorCode.UNKNOWN_SERVICE, self._unknown_message(msg.service))
            return
        bound = None
        if msg.header.get("bound") is not None:
            # A bound client's request goes to its own worker only (never queued for the pool).
            bound = next((w for w in self.workers.values() if w.bound_to == client.identity
                          and w.name == msg.header["bound"] and w.service == msg.service), None)
            if bound is None:
                self.send_error(client.identity, msg.request_id, ErrorCode.UNAVAILABLE,
                                f"no worker {msg.header['bound']!r} of {msg.service!r} is bound to this client",
                                unbound=True)
                return
        request = Request(msg.request_id, client.identity, msg.service, msg.header, msg.payload, now + timeout, now,
                          size)
        self.requests[msg.request_id] = request
        client.requests.add(msg.request_id)
        service = self.service(msg.service, now)
        self.metrics.requests.labels(service=msg.service).inc()
        if bound is not None:
            self.send_request(service, bound, request)
            return
        service.queues.setdefault(client.identity, collections.deque()).append(msg.request_id)
        self.dispatch(service)

    # ----------------------------------------------- NCCL binding (nccl.md)

    def bind(self, client: ClientState, msg: Message) -> None:
        """Give the client a worker of its own: refused at once (BOUND ok=false) when none is free;
        granted by the worker itself, which sends the client the rendezvous over its data socket."""
        if not msg.request_id:
            raise ProtocolError("BIND without a request id")
        if not _valid_endpoint(msg.header.get("reply_to")):
            raise ProtocolError("BIND header needs reply_to, a tcp://host:port or ipc:// endpoint")
        timeout = _request_timeout(msg.header)
        data_key, device_type = msg.header.get("data_key"), msg.header.get("device_type")
        if not isinstance(data_key, (str, type(None))) or not isinstance(device_type, (str, type(None))):
            raise ProtocolError("BIND header data_key and device_type must be strings")
        for worker in [w for w in self.workers.values() if w.bound_to == client.identity]:
            self.unbind(worker, "its client bound again")  # one binding per client
        service = self.services.get(msg.service)
        names = service.workers if service else []
        candidates = [self.workers[w] for w in names if self.workers[w].bound_to is None and not self.workers[w].leaving]
        if not candidates:
            error = (f"all {len(names)} workers of service {msg.service!r} are bound to other clients" if names
                     else f"no worker of service {msg.service!r} is registered")
            self.metrics.errors.labels(code=ErrorCode.UNAVAILABLE.value).inc()
            self._send(self.frontend, client.identity, control(CLIENT_TAG, ClientCommand.BOUND.value, msg.service,
                       msg.request_id, {"ok": False, "code": ErrorCode.UNAVAILABLE.value, "error": error}))
            return
        # Prefer an idle worker; a busy one finishes the jobs it holds first (BIND queues behind them).
        worker = min(candidates, key=lambda w: (len(w.inflight), w.idle_since))
        prefix = uuid.uuid4().hex
        worker.bound_to, worker.bind_prefix, worker.bind_request = client.identity, prefix, msg.request_id
        header = {"client": client.identity.hex(), "reply_to": msg.header["reply_to"], "prefix": prefix,
                  "timeout": timeout, "device_type": device_type}
        if data_key is not None:
            header["data_key"] = data_key
        if not self._send(self.backend, worker.identity, control(WORKER_TAG, WorkerCommand.BIND.value, msg.service,
                                                                 msg.request_id, header)):
            worker.bound_to, worker.bind_prefix, worker.bind_request = None, None, b""
            self._send(self.frontend, client.identity, control(CLIENT_TAG, ClientCommand.BOUND.value, msg.service,
                       msg.request_id, {"ok": False, "code": ErrorCode.UNAVAILABLE.value,
                                        "error": f"worker {worker.name} unreachable"}))
            return
        event(log, logging.INFO, "broker.bound", worker=worker.name, client=client.identity.hex()[:12])
        self._snapshot_stale = True

    def unbind(self, worker: WorkerState, reason: str, notify: bool = False) -> None:
        """End a binding: tell the worker (if alive) and, with ``notify``, the client; back to the pool."""
        client, prefix, request_id = worker.bound_to, worker.bind_prefix, worker.bind_request
        if client is None:
            return
        worker.bound_to, worker.bind_prefix, worker.bind_request = None, None, b""
        alive = worker.identity in self.workers
        if alive:
            self._send(self.backend, worker.identity, control(WORKER_TAG, WorkerCommand.RELEASE.value, worker.service,
                                                              b"", {"prefix": prefix}))
        if notify and client in self.clients:
            self._send(self.frontend, client, control(CLIENT_TAG, ClientCommand.BOUND.value, worker.service, request_id,
                       {"ok": False, "lost": worker.name, "prefix": prefix,
                        "error": f"bound worker {worker.name} lost: {reason}"}))
        event(log, logging.INFO, "broker.unbound", worker=worker.name, client=client.hex()[:12], reason=reason)
        self._snapshot_stale = True
        if alive:
            self.dispatch(self.services[worker.service])

    def register_mapping(self, client: ClientState, msg: Message) -> None:
        """Store a client's mapping (content-addressed) after dropping the registrations it releases."""
        if not self.pin_target(client, msg):
            return
        release = msg.header.get("release", [])
        if not isinstance(release, list) or len(release) > MAX_REQUESTS_PER_CLIENT + 1 \
                or not all(isinstance(d, str) for d in release):
            raise ProtocolError("SET_VOCAB 'release' must be a list of mapping digests")
        for digest in release:
            client.vocab.pop((msg.service, digest), None)
        try:
            tensors = wire.decode(msg.payload, max_bytes=self.max_message_bytes)
            ids, mask = tensors["selected_token_ids"], tensors["selected_token_mask"]
            service = self.services.get(msg.service)
            validate_vocab_mapping(ids, mask, service.vocab_size if service else None)
        except (wire.WireError, KeyError, ValueError) as e:
            self.send_error(client.identity, msg.request_id, ErrorCode.BAD_REQUEST, f"bad vocab mapping: {e}")
            return
        digest = mapping_digest(ids, mask)
        service = self.service(msg.service, time.monotonic())
        if digest not in service.mappings:
            if not self._can_hold(client, msg.request_id, sum(len(memoryview(f)) for f in msg.payload)):
                return
            service.mappings[digest] = [bytes(memoryview(f)) for f in msg.payload]
        client.vocab[(msg.service, digest)] = None
        client.vocab.move_to_end((msg.service, digest))
        while len(client.vocab) > MAX_MAPPINGS_PER_CLIENT:
            client.vocab.popitem(last=False)
        self._trim_mappings()
        self._send(self.frontend, client.identity, control(
            CLIENT_TAG, ClientCommand.VOCAB_OK.value, msg.service, msg.request_id, {"digest": digest}))

    def _trim_mappings(self) -> None:
        """Keep only live mappings: registered (and not released) by a connected client, or named by a
        request the broker holds. Workers keep their own copies until the broker evicts them."""
        live = {key for client in self.clients.values() for key in client.vocab}
        live.update((r.service, r.header["vocab"]) for r in self.requests.values() if "vocab" in r.header)
        for service in self.services.values():
            for digest in [d for d in service.mappings if (service.name, d) not in live]:
                del service.mappings[digest]
        self.mapping_bytes = sum(len(f) for service in self.services.values() for frames in service.mappings.values()
                                 for f in frames)

    def _can_hold(self, client: ClientState, request_id: bytes, size: int) -> bool:
        """Room for ``size`` more payload bytes; if not, the client is told to back off (it retries)."""
        held = self.requests.held + self.mapping_bytes
        if held + size <= self.max_held_bytes:
            return True
        self.send_error(client.identity, request_id, ErrorCode.UNAVAILABLE,
                        f"the broker holds {held} bytes of requests; {size} more would pass its limit of "
                        f"{self.max_held_bytes} (--max-held-bytes)")
        return False

    def delete_client(self, identity: bytes) -> None:
        """Forget a client: drop what it queued; what runs finishes and is discarded."""
        client = self.clients.pop(identity, None)
        if client is None:
            return
        for worker in [w for w in self.workers.values() if w.bound_to == identity]:
            self.unbind(worker, "client gone")
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

    def send_error(self, client: bytes, request_id: bytes, code: ErrorCode, message: str, **extra) -> None:
        self.metrics.errors.labels(code=code.value).inc()
        self._send(self.frontend, client, control(
            CLIENT_TAG, ClientCommand.ERROR.value, "", request_id, {"code": code.value, "error": message, **extra}))

    # --------------------------------------------------------------- workers

    def process_worker(self, identity: bytes, frames: list) -> None:
        msg = parse_control(frames, WORKER_TAG, WorkerCommand)
        now = time.monotonic()
        command = WorkerCommand(msg.command)
        worker = self.workers.get(identity)
        if command is WorkerCommand.READY:
            if worker is not None:
                self.delete_worker(worker, now, reason="re-registered", died=False)
            self.register_worker(identity, msg, now)
            return
        if worker is None:
            # Not registered (e.g. we restarted): ask it to register again.
            self._send(self.backend, identity, control(WORKER_TAG, WorkerCommand.DISCONNECT.value))
            return
        worker.expiry = now + self.heartbeat_interval * self.liveness
        if command is WorkerCommand.DONE:
            self.complete(worker, msg, now)
        elif command is WorkerCommand.HEARTBEAT:
            pass
        elif command is WorkerCommand.LEAVE:  # its engine died: its in-flight requests go elsewhere now
            self.metrics.worker_deaths.inc()
            # The request it was running got engine_dead already; those it held were never run: no suspects.
            self.delete_worker(worker, now, reason=f"left: {str(msg.header.get('reason'))[:200]}", died=False)
        else:
            raise ProtocolError(f"workers may not send {command.name}")

    def register_worker(self, identity: bytes, msg: Message, now: float) -> None:
        info = msg.header.get("target_info")
        capacity = msg.header.get("capacity", 1)
        if not isinstance(info, dict) or not isinstance(capacity, int) or capacity < 1:
            raise ProtocolError("READY needs target_info and a positive capacity")
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
        limit = msg.header.get("max_message_bytes")
        worker = WorkerState(identity, msg.service, info, capacity, now + self.heartbeat_interval * self.liveness,
                             time.time(), idle_since=now,
                             max_message_bytes=limit if isinstance(limit, int) and limit > 0 else None)
        self.workers[identity] = worker
        service.workers.append(identity)
        self.served[msg.service] = None
        self.served.move_to_end(msg.service)
        while len(self.served) > MAX_SERVED_NAMES:
            self.served.popitem(last=False)
        if service.vocab_size is None and isinstance(info.get("vocab_size"), int):
            service.vocab_size = info["vocab_size"]
        self.metrics.workers.labels(service=msg.service).set(len(service.workers))
        event(log, logging.INFO, "broker.worker_ready", worker=worker.name, service=msg.service,
              engine=info.get("engine"), capacity=capacity)
        self._snapshot_stale = True
        self.dispatch(service)

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
        self._send(self.backend, identity, control(WORKER_TAG, WorkerCommand.REFUSED.value, service.name,
                                                   header={"error": message}))

    def pin_target(self, client: ClientState, msg: Message) -> bool:
        """Note the target fingerprint a client's message names (the one it set up with); False, after
        answering ``target_changed``, if the service's workers now serve another."""
        fingerprint = msg.header.get("fingerprint")
        if fingerprint is None:
            return True
        if not isinstance(fingerprint, str) or len(fingerprint) > 128:
            raise ProtocolError("header 'fingerprint' must be a target fingerprint string")
        service = self.services.get(msg.service)
        serving = self.workers[service.workers[0]].info.get("fingerprint") if service and service.workers else None
        if serving is not None and serving != fingerprint:
            self.send_error(client.identity, msg.request_id, ErrorCode.TARGET_CHANGED,
                            f"service {msg.service!r} now serves target fingerprint {serving}, but this client set "
                            f"up with {fingerprint}: start a new client to use the new target")
            return False
        client.fingerprints[msg.service] = fingerprint
        return True

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
            request.worker = None
            if request.header.get("bound") is not None:
                # Its binding died with the worker: the client re-sends it as frames.
                self._forget_request(request)
                self.send_error(request.client, request_id, ErrorCode.UNAVAILABLE,
                                f"bound worker {worker.name} is gone ({reason})", unbound=True)
            elif died and self._killed_by(request, worker):
                continue
            elif request.client in self.clients:
                service.queues.setdefault(request.client, collections.deque()).appendleft(request_id)
                self.metrics.redispatched.inc()
            else:
                del self.requests[request_id]
        worker.inflight.clear()
        self.unbind(worker, reason, notify=True)
        self.metrics.workers.labels(service=worker.service).set(len(service.workers))
        event(log, logging.WARNING, "broker.worker_gone", worker=worker.name, service=worker.service, reason=reason)
        self._snapshot_stale = True
        self.dispatch(service)

    def _killed_by(self, request: Request, worker: WorkerState) -> bool:
        """Count ``worker``'s death against ``request``; True if that failed the request for good."""
        request.killed.append(worker.name)
        if len(request.killed) < self.max_request_deaths:
            return False  # a suspect from now on: dispatched alone (see _next_request)
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
        worker.inflight.discard(msg.request_id)
        worker.idle_since = now
        worker.leaving = worker.leaving or msg.header.get("status") == "engine_dead"
        request = self.requests.get(msg.request_id)
        if request is not None and request.worker == worker.identity:
            del self.requests[msg.request_id]
            client = self.clients.get(request.client)
            if client is not None:
                client.requests.discard(msg.request_id)
            status = msg.header.get("status", "ok")
            status = status if status in DONE_STATUSES else "error"
            self.metrics.completed.labels(service=worker.service, status=status).inc()
            if status == "undeliverable" and client is not None:
                # The worker dropped the reply at once (its slot is free): the client retries now,
                # instead of waiting out its timeout.
                self.send_error(request.client, msg.request_id, ErrorCode.UNAVAILABLE,
                                f"worker {worker.name} could not deliver the reply to "
                                f"{request.header.get('reply_to')}: {msg.header.get('error', 'not reading')}")
            if status == "ok":
                worker.completed += 1
                self.metrics.tokens.labels(service=worker.service).inc(int(msg.header.get("tokens", 0)))
                self.metrics.reply_bytes.labels(service=worker.service).inc(int(msg.header.get("bytes", 0)))
                self.metrics.latency.labels(service=worker.service).observe(now - request.enqueued_at)
        self.dispatch(self.services[worker.service])

    # -------------------------------------------------------------- dispatch

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
        avoid = request.header.get("avoid")
        if avoid is None or not any(self.workers[w].name != avoid and self.workers[w].bound_to is None
                                    for w in service.workers):
            return candidates
        return [w for w in candidates if w.name != avoid]

    def _holds_suspect(self, worker: WorkerState) -> bool:
        return any(self.requests[r].killed for r in worker.inflight if r in self.requests)

    def send_request(self, service: ServiceState, worker: WorkerState, request: Request) -> None:
        vocab = request.header.get("vocab")
        if vocab is not None and vocab not in worker.mappings:
            mapping = service.mappings.get(vocab)
            if mapping is None:
                self._forget_request(request)
                self.send_error(request.client, request.request_id, ErrorCode.BAD_REQUEST,
                                f"vocab mapping {vocab!r} is no longer registered", unknown_vocab=True)
                return
            # Sent on the same pipe just before the request, so it arrives first.
            header = {"digest": vocab, "evict": self._evict_mappings(worker)}
            self._send(self.backend, worker.identity, control(
                WORKER_TAG, WorkerCommand.SET_VOCAB.value, service.name, b"", header, mapping))
            worker.mappings[vocab] = None
        elif vocab is not None:
            worker.mappings.move_to_end(vocab)
        header = dict(request.header, client=request.client.hex())
        frames = control(WORKER_TAG, WorkerCommand.REQUEST.value, service.name, request.request_id, header,
                         request.payload)
        if not self._send(self.backend, worker.identity, frames):
            service.queues.setdefault(request.client, collections.deque()).appendleft(request.request_id)
            self.delete_worker(worker, time.monotonic(), reason="unreachable", died=True)
            return
        request.worker = worker.identity
        request.dispatches += 1
        request.dispatched_at = time.monotonic()
        worker.inflight.add(request.request_id)

    def _evict_mappings(self, worker: WorkerState) -> list[str]:
        """Make room on ``worker`` for one more mapping: drop its least recently used ones that no
        request on it names. The worker drops exactly these, so ``worker.mappings`` stays exact."""
        in_use = {self.requests[r].header.get("vocab") for r in worker.inflight if r in self.requests}
        evicted = []
        for digest in list(worker.mappings):
            if len(worker.mappings) < MAX_WORKER_MAPPINGS:
                break
            if digest not in in_use:
                del worker.mappings[digest]
                evicted.append(digest)
        return evicted

    def _forget_request(self, request: Request) -> None:
        self.requests.pop(request.request_id, None)
        client = self.clients.get(request.client)
        if client is not None:
            client.requests.discard(request.request_id)

    # ------------------------------------------------- heartbeat and purge

    def heartbeat(self, now: float) -> None:
        beat = control(WORKER_TAG, WorkerCommand.HEARTBEAT.value)
        for worker in list(self.workers.values()):
            self._send(self.backend, worker.identity, beat)
        beat = control(CLIENT_TAG, ClientCommand.HEARTBEAT.value, header={"broker": self.instance_id})
        for identity in list(self.clients):
            if not self._send(self.frontend, identity, beat):
                self.delete_client(identity)

    def purge(self, now: float) -> None:
        """Expire silent workers and clients, and requests past their deadline."""
        for worker in [w for w in self.workers.values() if w.expiry < now]:
            self.metrics.worker_deaths.inc()
            self.delete_worker(worker, now, reason="heartbeat expired", died=True)
        for identity in [c.identity for c in self.clients.values() if c.expiry < now]:
            self.delete_client(identity)
        for request in [r for r in self.requests.values()
                        if r.worker is not None and now > r.dispatched_at + _request_timeout(r.header)]:
            self.deadline_missed(request)
        for service in self.services.values():
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
        self._trim_mappings()
        self._forget_idle_services(now)
        for service in self.services.values():
            self.metrics.queue_depth.labels(service=service.name).set(service.queue_depth())
        self.metrics.inflight.set(sum(1 for r in self.requests.values() if r.worker is not None))

    def deadline_missed(self, request: Request) -> None:
        """Its worker held it past its timeout: dead for this request. It goes to another worker with a
        fresh deadline (the slot stays taken until the worker answers; a late DONE is ignored, a late
        reply the client drops as a duplicate)."""
        worker = self.workers.get(request.worker)
        event(log, logging.WARNING, "broker.deadline_missed", request=request.request_id.hex()[:12],
              worker=worker.name if worker else request.worker.hex()[:12])
        request.missed.add(request.worker)
        request.worker = None
        if request.header.get("bound") is not None:  # its binding is no use: the client re-sends it as frames
            self._forget_request(request)
            self.send_error(request.client, request.request_id, ErrorCode.UNAVAILABLE,
                            f"bound worker {worker.name if worker else '?'} missed the request's deadline", unbound=True)
            return
        request.deadline = max(request.deadline, time.monotonic() + _request_timeout(request.header))
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
                self._snapshot_stale = True

    def _unknown(self, name: str, now: float) -> bool:
        """No worker ever served it, and the grace since its first use (workers still loading) is over."""
        service = self.services.get(name)
        return name not in self.served and service is not None and now - service.created_at > UNKNOWN_SERVICE_GRACE

    def _unknown_message(self, name: str) -> str:
        known = sorted(s for s, st in self.services.items() if st.workers)
        return f"unknown service {name!r}: no worker serves it; services with workers: {known}"

    # ----------------------------------------------------------------- util

    def _send(self, sock: zmq.Socket, identity: bytes, frames: list) -> bool:
        """Send without blocking; False if the peer is gone or saturated."""
        try:
            sock.send_multipart([identity, *frames], flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.ZMQError as e:
            if e.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                return False
            raise

    def status(self) -> dict[str, Any]:
        """Workers, services and queues, all of them: the HTTP shim's snapshot."""
        now = time.monotonic()
        return dict(self._status_summary(),
                    services={name: self._service_status(s) for name, s in self.services.items()},
                    workers=[self._worker_status(w, now) for w in self.workers.values()])

    def status_page(self, query: dict[str, Any]) -> dict[str, Any]:
        """One STATUS reply: the summary, then services and workers in a stable order, as many as fit
        STATUS_PAGE_BYTES, after the cursor ``query["after"]``; ``next`` is the cursor of the next page
        (None on the last). ``query["service"]`` limits it to one service and its workers."""
        only, after = _status_query(query)
        services, workers, used, last, more = {}, [], 0, None, False
        for key, entry in self._status_items(only, time.monotonic()):
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
        return dict(self._status_summary(), services=services, workers=workers,
                    next=list(last) if more else None)

    def _status_items(self, only: str | None, now: float):
        """``((0, name), service entry)`` for every service, then ``((1, service, identity), worker entry)``
        for every worker, each in sorted order (a page's cursor is the last key it holds)."""
        if only is None:
            names, chosen = sorted(self.services), list(self.workers.values())
        elif only in self.services:
            names, chosen = [only], [self.workers[i] for i in self.services[only].workers]
        else:
            names, chosen = [], []
        for name in names:
            yield (0, name), self._service_status(self.services[name])
        for worker in sorted(chosen, key=lambda w: (w.service, w.identity.hex())):
            yield (1, worker.service, worker.identity.hex()), self._worker_status(worker, now)

    def _status_summary(self) -> dict[str, Any]:
        return {
            "broker": self.instance_id,
            "uptime_s": round(time.time() - self.started_at, 3),
            "unknown_service_grace_s": UNKNOWN_SERVICE_GRACE,
            "clients": len(self.clients),
            "inflight": sum(1 for r in self.requests.values() if r.worker is not None),
            "queued": sum(s.queue_depth() for s in self.services.values()),
            "service_count": len(self.services),
            "worker_count": len(self.workers),
            "max_message_bytes": self.max_message_bytes,  # the largest request this broker accepts
        }

    def _service_status(self, service: ServiceState) -> dict[str, Any]:
        return {
            "workers": len(service.workers),
            "ready_workers": sum(1 for w in service.workers if self.workers[w].bound_to is None),
            "queue_depth": service.queue_depth(),
            "vocab_mappings": len(service.mappings),
            "ever_had_workers": service.name in self.served,
        }

    def _worker_status(self, w: WorkerState, now: float) -> dict[str, Any]:
        return {
            "id": w.name,
            "service": w.service,
            "state": "bound" if w.bound_to else ("busy" if w.inflight else "idle"),
            "bound_to": w.bound_to.hex()[:12] if w.bound_to else None,
            "inflight": len(w.inflight),
            "capacity": w.capacity,
            "completed": w.completed,
            "last_seen_s": round(max(0.0, self.heartbeat_interval * self.liveness - (w.expiry - now)), 3),
            "registered_at": w.registered_at,
            "max_message_bytes": w.max_message_bytes,
            "target_info": w.info,
        }

    def update_snapshot(self) -> None:
        self._snapshot_stale = False
        snap = self.status()
        self.metrics.set_worker_states(snap["workers"])
        with self._snapshot_lock:
            self._snapshot = snap

    def snapshot(self) -> dict[str, Any]:
        """The latest status, safe to read from another thread (the HTTP shim)."""
        with self._snapshot_lock:
            return self._snapshot


def _port_name(endpoint: str) -> str:
    """The port number of a tcp endpoint, the endpoint itself otherwise."""
    return endpoint.rpartition(":")[2] if endpoint.startswith("tcp://") else endpoint


def _request_timeout(header: dict[str, Any]) -> float:
    """The request's ``timeout`` header (seconds), checked: a finite positive number."""
    timeout = header.get("timeout", 120)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < 1e7:
        raise ProtocolError(f"REQUEST header 'timeout' must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


def _status_query(query: dict[str, Any]) -> tuple[str | None, tuple | None]:
    """STATUS header ``{"service": name, "after": cursor}`` (both optional), checked."""
    only, after = query.get("service"), query.get("after")
    if only is not None and not isinstance(only, str):
        raise ProtocolError("STATUS 'service' must be a service name")
    if after is None:
        return only, None
    valid = isinstance(after, list) and (
        (len(after) == 2 and after[0] == 0 and isinstance(after[1], str))
        or (len(after) == 3 and after[0] == 1 and all(isinstance(k, str) for k in after[1:])))
    if not valid:
        raise ProtocolError("STATUS 'after' must be the 'next' cursor of an earlier page")
    return only, tuple(after)


def _valid_endpoint(endpoint: Any) -> bool:
    """A ``reply_to`` a worker may connect to: ``tcp://host:port`` or ``ipc://path``."""
    if not isinstance(endpoint, str) or len(endpoint) > 512:
        return False
    if endpoint.startswith("ipc://"):
        return len(endpoint) > 6 and "\x00" not in endpoint
    if not endpoint.startswith("tcp://"):
        return False
    host, _, port = endpoint[6:].rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536 and "*" not in host


def mapping_digest(ids, mask) -> str:
    """Content address of a draft-vocab mapping: equal mappings, equal digests."""
    h = hashlib.sha256()
    h.update(ids.contiguous().view(-1).numpy().tobytes())
    h.update(mask.contiguous().view(-1).to(dtype=mask.dtype).numpy().tobytes())
    return h.hexdigest()[:32]
