"""The broker: a Majordomo-style ROUTER/ROUTER load balancer for supervision.

Clients talk to the frontend, workers to the backend. This module is the plumbing: the two sockets,
the poll loop, and a table from each command to the handler that serves it. What the broker decides
lives beside it: routing.py puts the parts together (workers.py the registry, services.py the queues,
dispatch.py dispatch and re-dispatch, poison.py the poison-request policy, binding.py bindings (a worker
a client holds), clients.py client state, vocab_registry.py draft-vocab mappings), parts.py joins payloads
sent in parts, status.py answers STATUS and keeps the HTTP shim's snapshot.
Bulk reply bytes go from worker to client directly; the broker only sees a small DONE. Method names
follow the Majordomo spec: ``process_client``, ``process_worker``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import zmq

from spec_serve.broker.clients import DEFAULT_CLIENT_HELD_SHARE, DEFAULT_MAX_HELD_BYTES
from spec_serve.broker.context import Peer
from spec_serve.broker.parts import Parts
from spec_serve.broker.routing import DEFAULT_SIZING_WINDOW, Router
from spec_serve.broker.state import ClientState, WorkerState
from spec_serve.broker.status import Snapshot, status_page
from spec_serve.protocol.commands import (
    CLIENT_TAG,
    DEFAULT_MAX_REQUEST_TOKENS,
    HEARTBEAT_INTERVAL,
    HEARTBEAT_LIVENESS,
    MAX_HEADER_BYTES,
    PART_BYTES,
    PART_FRAMES,
    REQUEST_ID_BYTES,
    WORKER_TAG,
    ClientCommand,
    ErrorCode,
    Message,
    ProtocolError,
    WorkerCommand,
    control,
    frame_limit,
    parse_control,
    request_bytes,
)
from spec_serve.protocol.messages import (
    BindRequest,
    BrokerError,
    BrokerHeartbeat,
    Disconnect,
    Done,
    Leave,
    Ready,
    Refused,
    Release,
    SetVocab,
    StatusQuery,
    SupervisionRequest,
    WireMessage,
)
from spec_serve.telemetry.logs import Throttle, event
from spec_serve.transport.bounded import BoundedReader, Overlong
from spec_serve.transport.ingress import Ingress
from spec_serve.transport.sockets import (
    DEFAULT_MAX_MESSAGE_BYTES,
    KEYS_DIR_FLAG,
    KeyPolicy,
    Security,
    bound_endpoint,
    check_exposure,
    endpoint_host,
    make_socket,
    plain_address,
)

log = logging.getLogger("spec_serve.broker")

# Messages drained from one socket before looking at the other (fairness).
DRAIN_BATCH = 64
# Each socket's bounds (transport/ingress.py): the bytes on the wire of a message that is not whole yet,
# per connection (over the largest message a peer of that side sends, and a read of libzmq's) and for all
# together; and a connection's backlog, what it may hold undelivered while the broker is too busy to read:
# READ_AHEAD whole messages (libzmq reads no further ahead: the socket's RCVHWM), one read, one unfinished.
# libzmq keeps up to 32 times the wire bytes for a message of empty frames (64 bytes a frame, 2 on the wire).
# Workers send the broker control messages only: no frame above a header, little per connection.
BACKEND_FRAME_BYTES = MAX_HEADER_BYTES + 4096
BACKEND_CONNECTION_BYTES = 2 * MAX_HEADER_BYTES
BACKEND_TOTAL_BYTES = 8 << 20
BACKEND_READ_AHEAD = 16
BACKEND_BACKLOG_BYTES = (BACKEND_READ_AHEAD + 2) * BACKEND_CONNECTION_BYTES
# Clients send payloads in parts (protocol.commands.in_parts): no message above a part and a header.
# All together: at least FRONTEND_TOTAL_BYTES, and a connection's bound for every client the broker knows
# (each may be caught mid-part on a slow link), up to --max-held-bytes (frontend_total).
FRONTEND_FRAME_BYTES = max(PART_BYTES, MAX_HEADER_BYTES) + 4096
FRONTEND_CONNECTION_BYTES = PART_BYTES + 2 * MAX_HEADER_BYTES
FRONTEND_TOTAL_BYTES = 16 << 20
FRONTEND_READ_AHEAD = 4
FRONTEND_BACKLOG_BYTES = (FRONTEND_READ_AHEAD + 2) * FRONTEND_CONNECTION_BYTES
# A peer on the wrong port is answered every time, but logged once per this many seconds.
WRONG_PORT_LOG_INTERVAL_S = 60.0
# A refused message's connection is cut this long after its answer was queued: a shutdown discards what
# libzmq has not yet written, and the answer must reach the client first (its bytes are bounded meanwhile).
ANSWER_GRACE_S = 1.0
# At most one line per refused CURVE peer (address and role) in this window; every refusal is counted.
CURVE_REFUSAL_LOG_INTERVAL_S = 60.0
# How long a stopping broker lets its last words to clients and workers leave before it closes.
GOODBYE_LINGER_MS = 1000
# The loop turns at least every 0.25 s; one that has not turned for this long (or twice the peers' expiry
# window, if longer) is stalled, and /health says so.
LOOP_STALL_S = 10.0
# Why a CURVE broker refuses BIND at once, before it takes a worker out of the pool (workers refuse it too).
CURVE_BIND_REFUSAL = ("this broker runs CURVE: a binding's rendezvous (its store and connections) "
                      "cannot be authenticated, so bindings are refused; replies stay CURVE frames")

# A handler gets the sender's state, the message and its header typed (None for an empty one), and the time.
ClientHandler = Callable[[ClientState, Message, Any, float], None]
WorkerHandler = Callable[[WorkerState, Message, Any, float], None]


class BindError(OSError):
    """The broker cannot bind one of its endpoints; ``role`` says which ("frontend" or "backend")."""

    def __init__(self, role: str, endpoint: str, reason: str, in_use: bool = False):
        super().__init__(f"cannot bind the {role} {endpoint}: {reason}")
        self.role, self.endpoint, self.reason, self.in_use = role, endpoint, reason, in_use


@contextlib.contextmanager
def _binding(role: str, endpoint: str) -> Iterator[None]:
    """Turn a failed bind of ``endpoint`` into a BindError that names the role and the likely cause."""
    try:
        yield
    except zmq.ZMQError as e:
        reason, in_use = e.strerror, e.errno == zmq.EADDRINUSE
        if in_use:
            reason = "address already in use (another broker running? choose a free port)"
        raise BindError(role, endpoint, reason, in_use) from e


def _check_listeners(frontend: str, backend: str, security: Security | None, insecure_network: bool) -> None:
    """Refuse what the broker must not listen with, before it opens a socket: a CURVE broker without both key
    sets (ValueError), an unauthenticated bind other hosts reach (ExposureError, protected mode)."""
    # With CURVE, clients' keys on the frontend and workers' keys on the backend, never one set for both
    # (an admitted client key must not register as a worker).
    if security is not None and (security.client_keys_dir is None or security.worker_keys_dir is None):
        raise ValueError("a CURVE broker needs client_keys_dir and worker_keys_dir (separate key sets)")
    # Protected mode: a port other hosts reach admits only CURVE keys, unless the user said otherwise.
    for flag, endpoint in (("--frontend", frontend), ("--backend", backend)):
        host = endpoint_host(endpoint)
        if host is not None:
            check_exposure(host, f"the broker's {flag} {endpoint}", authenticated=security is not None,
                           insecure_network=insecure_network)


# The typed header of each command the broker serves (None: an empty header), read once, before its handler
# runs: a bad one is a ProtocolError naming the message and the key.
CLIENT_HEADERS: dict[ClientCommand, type[WireMessage] | None] = {
    ClientCommand.REQUEST: SupervisionRequest, ClientCommand.SET_VOCAB: SetVocab, ClientCommand.STATUS: StatusQuery,
    ClientCommand.DISCONNECT: None, ClientCommand.BIND: BindRequest, ClientCommand.RELEASE: Release,
    ClientCommand.HEARTBEAT: None,
}
WORKER_HEADERS: dict[WorkerCommand, type[WireMessage] | None] = {
    WorkerCommand.READY: Ready, WorkerCommand.DONE: Done, WorkerCommand.LEAVE: Leave, WorkerCommand.HEARTBEAT: None,
}


def typed_header(msg: Message, typed: type[WireMessage] | None) -> Any:
    """``msg``'s header as its typed message (None for a command whose header is empty)."""
    return typed.from_json(msg.header) if typed is not None else None


def _ignore(peer: Any, msg: Message, header: None, now: float) -> None:
    """HEARTBEAT: receiving it already extended the peer's expiry."""


class Broker:
    """Owns the two ROUTER sockets and runs the single-threaded loop that feeds the router."""

    def __init__(
        self,
        frontend: str = "tcp://127.0.0.1:5555",
        backend: str = "tcp://127.0.0.1:5556",
        *,
        security: Security | None = None,
        insecure_network: bool = False,
        heartbeat_interval: float = HEARTBEAT_INTERVAL,
        liveness: int = HEARTBEAT_LIVENESS,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS,
        max_request_deaths: int = 2,
        max_held_bytes: int = DEFAULT_MAX_HELD_BYTES,
        client_held_share: float = DEFAULT_CLIENT_HELD_SHARE,
        sizing_window: float = DEFAULT_SIZING_WINDOW,
        context: zmq.Context | None = None,
    ):
        # A request holds at most what max_request_tokens tokens need, whatever max_message_bytes allows.
        self.router = Router(self._send_to, heartbeat_interval=heartbeat_interval, liveness=liveness,
                             max_message_bytes=min(max_message_bytes, request_bytes(max_request_tokens)),
                             max_request_deaths=max_request_deaths, max_held_bytes=max_held_bytes,
                             client_held_share=client_held_share, sizing_window=sizing_window,
                             bind_refusal=CURVE_BIND_REFUSAL if security is not None else None)
        self.parts = Parts(self.router.max_message_bytes, self.router.client_table.room, self.router.ctx.send_error)
        self.router.client_table.reserved = self.parts.reserved_by
        self.metrics = self.router.metrics
        self.heartbeat_interval = heartbeat_interval
        self.ctx = context or zmq.Context.instance()
        self.curve = security is not None
        self._curve_log = Throttle(CURVE_REFUSAL_LOG_INTERVAL_S)
        self._curve_log_lock = threading.Lock()  # refusals are heard on the ZAP handler's thread
        _check_listeners(frontend, backend, security, insecure_network)
        self._open(frontend, backend, security)
        self.frontend_endpoint = bound_endpoint(self.frontend)
        self.backend_endpoint = bound_endpoint(self.backend)
        self._client_handlers: dict[ClientCommand, ClientHandler] = {
            ClientCommand.REQUEST: self.router.enqueue,
            ClientCommand.SET_VOCAB: self.router.register_mapping,
            ClientCommand.STATUS: self._answer_status,
            ClientCommand.DISCONNECT: self.router.disconnect,
            ClientCommand.BIND: self.router.bindings.bind,
            ClientCommand.RELEASE: self.router.bindings.release,
            ClientCommand.HEARTBEAT: self.router.client_heartbeat,
        }
        # READY is served before this table: it is the one command an unregistered worker may send.
        self._worker_handlers: dict[WorkerCommand, WorkerHandler] = {
            WorkerCommand.DONE: self.router.complete,
            WorkerCommand.HEARTBEAT: _ignore,
            WorkerCommand.LEAVE: self.router.worker_left,
        }
        # Messages are read frame by frame; one with more frames than its kind has is refused unread.
        self.readers = {self.frontend: BoundedReader(self.frontend, lambda head: frame_limit(head, PART_FRAMES),
                                                     router=True, ingress=self.ingress[self.frontend]),
                        self.backend: BoundedReader(self.backend, lambda head: frame_limit(head, 0), router=True,
                                                    ingress=self.ingress[self.backend])}
        self._refusal_log = Throttle(WRONG_PORT_LOG_INTERVAL_S)
        self._stalled = False  # a refused message was being discarded at the last tick
        self._snapshot = Snapshot(stall_s=max(LOOP_STALL_S, 2 * heartbeat_interval * liveness))
        self._stop = threading.Event()
        self._wrong_port_log = Throttle(WRONG_PORT_LOG_INTERVAL_S)

    def _open(self, frontend: str, backend: str, security: Security | None) -> None:
        """Create and bind both sockets, each watched by an Ingress (what a peer can make libzmq hold
        before a message is whole; the sockets bind once watched)."""
        # Held for the broker's life: a socket admits nobody once its KeyPolicy is gone.
        self.client_keys = KeyPolicy(security.client_keys_dir, "client", self._curve_refused) if security else None
        self.worker_keys = KeyPolicy(security.worker_keys_dir, "worker", self._curve_refused) if security else None
        # libzmq drops a peer that sends a frame over this, before allocating it.
        self.frontend = make_socket(self.ctx, zmq.ROUTER, security=security, admit=self.client_keys,
                                    max_frame_bytes=FRONTEND_FRAME_BYTES)
        self.backend = make_socket(self.ctx, zmq.ROUTER, security=security, admit=self.worker_keys,
                                   max_frame_bytes=BACKEND_FRAME_BYTES)
        # Set before binding: a connection's pipe takes the high-water mark it had when it connected.
        self.frontend.setsockopt(zmq.RCVHWM, FRONTEND_READ_AHEAD)
        self.backend.setsockopt(zmq.RCVHWM, BACKEND_READ_AHEAD)
        front = None
        try:
            with _binding("frontend", frontend):
                front = Ingress(self.frontend, "broker.frontend", bind=frontend, router=True,
                                per_connection=FRONTEND_CONNECTION_BYTES, total=self._frontend_total,
                                backlog=FRONTEND_BACKLOG_BYTES, answer_cuts=True,
                                on_handshake_failed=lambda peer: self._curve_refused(peer, "client", "handshake"))
            with _binding("backend", backend):
                back = Ingress(self.backend, "broker.backend", bind=backend, router=True,
                               per_connection=BACKEND_CONNECTION_BYTES, total=BACKEND_TOTAL_BYTES,
                               backlog=BACKEND_BACKLOG_BYTES,
                               on_handshake_failed=lambda peer: self._curve_refused(peer, "worker", "handshake"))
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

    def _frontend_total(self) -> int:
        """The bytes of unfinished messages all client connections together may hold (read by the ingress
        watcher thread: ``len`` of the client table is one atomic read)."""
        return frontend_total(len(self.router.clients), self.router.client_table.max_held_bytes)

    # ------------------------------------------------------------------ loop

    def run(self) -> None:
        """Serve until ``stop()``; never raises on a peer's bad message."""
        poller = zmq.Poller()
        poller.register(self.frontend, zmq.POLLIN)
        poller.register(self.backend, zmq.POLLIN)
        next_tick = time.monotonic()
        tick = min(self.heartbeat_interval, 0.25)
        event(log, logging.INFO, "broker.start", frontend=self.frontend_endpoint, backend=self.backend_endpoint,
              curve="on" if self.curve else "off")
        self.update_snapshot()
        try:
            while not self._stop.is_set():
                self._snapshot.turned(time.monotonic())
                poller.poll(int(tick * 1000))
                # Every turn reads both sockets until a read finds nothing: that read tells their ingress
                # watchers no whole message waits, even on a turn the poll did not wake for them.
                self._drain(self.backend, self.process_worker)
                self._drain(self.frontend, self.process_client)
                self._tell_cut_clients()
                now = time.monotonic()
                if now >= next_tick:
                    self._tick(now)
                    next_tick = now + self.heartbeat_interval
                # rebuilt once per loop turn, not once per message (O(workers) each)
                if self.router.status_stale:
                    self.update_snapshot()
            self._say_goodbye()
        finally:
            linger = GOODBYE_LINGER_MS if self._stop.is_set() else 0
            self._snapshot.turned(None)
            for ingress in self.ingress.values():
                ingress.close()
            self.frontend.close(linger)
            self.backend.close(linger)
            event(log, logging.INFO, "broker.stop")

    def _tick(self, now: float) -> None:
        """Once a heartbeat interval: expire what is overdue and heartbeat every peer. While a refused message
        is being discarded, the messages queued behind it on its socket cannot be read, so nobody expires;
        once it is gone every peer gets a fresh liveness window (a peer that died meanwhile is noticed one
        window later)."""
        if any(reader.discarding for reader in self.readers.values()):
            self._stalled = True
        else:
            if self._stalled:
                self._stalled = False
                for identity in list(self.router.workers):
                    self.router.worker_seen(identity, now)
                for identity in list(self.router.clients):
                    self.router.client_seen(identity, now)
            self.parts.expire(now, self.router.clients.__contains__)
            self.router.purge(now)
        self.router.heartbeat(now)
        self.router.measure(now)
        self.router.status_stale = True

    def stop(self) -> None:
        """Stop (thread- and signal-safe): the loop tells its clients and workers, then ends."""
        self._stop.set()

    def _say_goodbye(self) -> None:
        """Told to stop: every client hears it (a last heartbeat, ``stopping``) and waits for a successor, to
        which it re-sends what it has pending; every worker is asked to register again (DISCONNECT,
        ``stopping``), and its READY reaches that successor. Replies on their way from workers still reach
        their clients directly."""
        router = self.router
        bye = control(CLIENT_TAG, ClientCommand.HEARTBEAT.value,
                      header=BrokerHeartbeat(router.instance_id, stopping=True))
        for identity in list(router.clients):
            self._send(self.frontend, identity, bye)
        again = control(WORKER_TAG, WorkerCommand.DISCONNECT.value, header=Disconnect(stopping=True))
        for identity in list(router.workers):
            self._send(self.backend, identity, again)
        event(log, logging.INFO, "broker.stopping", clients=len(router.clients), workers=len(router.workers),
              queued=sum(s.queue_depth() for s in router.services.values()),
              inflight=sum(1 for r in router.requests.values() if r.worker is not None))

    def _drain(self, sock: zmq.Socket, handler: Callable[[bytes, list], None]) -> None:
        for _ in range(DRAIN_BATCH):
            frames = self.readers[sock].read()
            if frames is None:  # nothing more now, or a refused message still being thrown away
                return
            if isinstance(frames, Overlong):
                self._refuse(sock, frames)
                continue
            identity, body = frames[0].bytes, frames[1:]
            if self._wrong_port(sock, identity, body):
                continue
            try:
                handler(identity, body)
            except ProtocolError as e:
                self.metrics.bad_messages.inc()
                event(log, logging.WARNING, "broker.bad_message", peer=identity.hex()[:12], error=e)
                if sock is self.frontend:
                    self.router.ctx.send_error(identity, e.request_id, ErrorCode.BAD_REQUEST, str(e))
            except Exception as e:  # a bug must not take the broker down
                self.metrics.bad_messages.inc()
                log.exception("broker.handler_failed peer=%s error=%s", identity.hex()[:12], e)

    def _refuse(self, sock: zmq.Socket, refused: Overlong) -> None:
        """A message with more frames than its kind may have: count it, tell a client why (under the
        message's request id), and cut its connection (a client would never send it) once that answer has
        had ``ANSWER_GRACE_S`` to leave; its remaining frames are being discarded unread."""
        side = "frontend" if sock is self.frontend else "backend"
        self.metrics.refused_messages.labels(socket=side).inc()
        why = f"a message of more than {refused.limit} frames, more than its kind has"
        identity = refused.frames[0].bytes
        held = self._refusal_log.ready(side, time.monotonic())
        if held is not None:
            event(log, logging.WARNING, "broker.refused_message", socket=side, peer=identity.hex()[:12],
                  reason=why, similar_since_last=held)
        if sock is self.frontend:
            request_id = refused.frames[4].bytes if len(refused.frames) > 4 else b""
            self.router.ctx.send_error(identity, request_id if len(request_id) == REQUEST_ID_BYTES else b"",
                                       ErrorCode.BAD_REQUEST, f"refused unread: {why}")
        self.ingress[sock].cut(refused.source_fd, why, after=ANSWER_GRACE_S if sock is self.frontend else 0.0)

    def _curve_refused(self, address: str, role: str, cause: str = "key") -> None:
        """A peer's handshake for ``role`` failed (on the ZAP handler's or the ingress watcher's thread):
        ``cause`` "key", its CURVE key is not admitted, or "handshake", the two ends' CURVE settings differ.
        Counted, and logged once per peer address, role and cause a window, naming the fix."""
        address = plain_address(address)
        self.metrics.curve_refusals.labels(role=role, cause=cause).inc()
        with self._curve_log_lock:
            held = self._curve_log.ready(f"{role} {cause} {address}", time.monotonic())
        if held is None:
            return
        if cause == "key":
            why = f"its public key is not in {KEYS_DIR_FLAG.get(role, 'the admitted keys')}"
        elif self.curve:
            why = ("its CURVE handshake failed: its --curve-server-key is not this broker's public key, it has no "
                   "CURVE, or it does not speak ZeroMQ")
        else:
            why = "its handshake failed: it uses CURVE and this broker does not (no --curve-secret-key)"
        event(log, logging.WARNING, "broker.curve_refused", peer=address, role=role, reason=why,
              similar_since_last=held)

    def _tell_cut_clients(self) -> None:
        """Each client connection the frontend's ingress is cutting for a message it could not finish within
        its bound hears why first (``bad_request``, no request id: that message's was never read)."""
        for identity, why in self.ingress[self.frontend].take_told():
            self.router.ctx.send_error(identity, b"", ErrorCode.BAD_REQUEST,
                                       f"connection cut: {why} (more frames or bytes than any message has)")

    def _wrong_port(self, sock: zmq.Socket, identity: bytes, frames: list) -> bool:
        """A client on the workers' port, or a worker on the clients' port: tell it which port it
        reached (it fails fast with that) and log it, rate-limited. True if it was one."""
        tag = frames[0].bytes if frames else b""
        wrong = _wrong_port_answer(sock is self.backend, tag, self.frontend_endpoint, self.backend_endpoint)
        if wrong is None:
            return False
        port, answer = wrong
        self.metrics.bad_messages.inc()
        self.metrics.errors.labels(code=ErrorCode.WRONG_PORT.value).inc()
        self._send(sock, identity, answer)
        held = self._wrong_port_log.ready(port, time.monotonic())
        if held is not None:
            event(log, logging.WARNING, "broker.wrong_port", port=port, peer=identity.hex()[:12],
                  peer_type="client" if tag == CLIENT_TAG else "worker", similar_since_last=held)
        return True

    # ------------------------------------------------------------------ commands

    def process_client(self, identity: bytes, frames: list) -> None:
        received = parse_control(frames, CLIENT_TAG, ClientCommand)
        now = time.monotonic()
        client = self.router.client_seen(identity, now)
        msg = self.parts.take(identity, received, now)  # a payload sent in parts is joined first
        if msg is None:
            return
        command = ClientCommand(msg.command)
        try:
            handler = self._client_handlers.get(command)
            if handler is None:
                raise ProtocolError(f"clients may not send {command.name}")
            handler(client, msg, typed_header(msg, CLIENT_HEADERS[command]), now)
        except ProtocolError as e:  # name the request, so its sender fails it at once
            raise ProtocolError(str(e), e.request_id or msg.request_id) from None

    def _answer_status(self, client: ClientState, msg: Message, query: StatusQuery, now: float) -> None:
        self.router.ctx.to_client(client.identity, control(
            CLIENT_TAG, ClientCommand.STATUS.value, msg.service, msg.request_id, status_page(self.router, query)))

    def process_worker(self, identity: bytes, frames: list) -> None:
        msg = parse_control(frames, WORKER_TAG, WorkerCommand)
        now = time.monotonic()
        command = WorkerCommand(msg.command)
        if command is WorkerCommand.READY:
            self.router.worker_ready(identity, msg, typed_header(msg, Ready), now)
            return
        worker = self.router.worker_seen(identity, now)
        if worker is None:
            # Not registered (e.g. we restarted): ask it to register again.
            self.router.ctx.to_worker(identity, control(WORKER_TAG, WorkerCommand.DISCONNECT.value))
            return
        handler = self._worker_handlers.get(command)
        if handler is None:
            raise ProtocolError(f"workers may not send {command.name}")
        handler(worker, msg, typed_header(msg, WORKER_HEADERS[command]), now)

    # ------------------------------------------------------------------ sending and status

    def _send_to(self, peer: Peer, identity: bytes, frames: list) -> bool:
        """The router's ``send``: clients on the frontend, workers on the backend."""
        return self._send(self.frontend if peer is Peer.CLIENT else self.backend, identity, frames)

    def _send(self, sock: zmq.Socket, identity: bytes, frames: list) -> bool:
        """Send without blocking; False if the peer is gone or saturated."""
        try:
            sock.send_multipart([identity, *frames], flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.ZMQError as e:
            if e.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                return False
            raise

    def update_snapshot(self) -> None:
        self.router.status_stale = False
        self.metrics.set_worker_states(self._snapshot.update(self.router)["workers"])

    def snapshot(self) -> dict[str, Any]:
        """The latest status, safe to read from another thread (the HTTP shim): status.Snapshot.read."""
        return self._snapshot.read()


def frontend_total(known_clients: int, max_held_bytes: int) -> int:
    """The frontend's bound on unfinished messages of all connections together: a connection's bound for each
    client the broker knows (and one not known yet), capped by --max-held-bytes, never below
    FRONTEND_TOTAL_BYTES. A stranger who never finished a message is known to nobody, so connections cannot
    grow it; honest clients caught mid-part over a shared slow link are not cut for being many."""
    return max(FRONTEND_TOTAL_BYTES, min(max_held_bytes, (known_clients + 1) * FRONTEND_CONNECTION_BYTES))


def _wrong_port_answer(on_backend: bool, tag: bytes, frontend: str, backend: str) -> tuple[str, list] | None:
    """For a client (``tag``) on the backend or a worker on the frontend: the port it reached and the answer
    naming the right one (an ERROR for a client, a REFUSED for a worker); None for a peer on its own port."""
    clients, workers = _port_name(frontend), _port_name(backend)
    code = ErrorCode.WRONG_PORT.value
    if on_backend and tag == CLIENT_TAG:
        error = BrokerError(code=code, error=(f"this is the spec-serve broker's worker port ({workers}); "
                                              f"clients connect to its client port ({clients}, --frontend)"))
        return "backend", control(CLIENT_TAG, ClientCommand.ERROR.value, "", b"", error)
    if not on_backend and tag == WORKER_TAG:
        refused = Refused(code=code, error=(f"this is the spec-serve broker's client port ({clients}); "
                                            f"workers connect to its worker port ({workers}, --backend)"))
        return "frontend", control(WORKER_TAG, WorkerCommand.REFUSED.value, "", b"", refused)
    return None


def _port_name(endpoint: str) -> str:
    """The port number of a tcp endpoint, the endpoint itself otherwise."""
    return endpoint.rpartition(":")[2] if endpoint.startswith("tcp://") else endpoint
