"""The training-side client: ``RemoteTargetModel`` has the colocated target's surface.

Requests go to the broker over a DEALER socket; replies come straight from the
worker to a PULL socket the client binds (its address travels in the request).
One I/O thread owns both sockets, heartbeats the broker, retries with the same
request id when the broker or a worker is lost, and drops duplicate replies.
User threads talk to it through a queue and a wake-up pipe.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import os
import queue
import threading
import time
import types
import uuid
from typing import Any, Callable, Mapping, Sequence

import torch
import zmq

from spec_serve.protocol import digest

from spec_serve.transport import samehost

from spec_serve.protocol import wire
from spec_serve.transport.connwatch import ConnectWatch, connect_watched
from spec_serve.supervision.contract import (
    Kind,
    ReplySpecs,
    TargetInfo,
    reply_bytes,
    reply_specs,
    validate_reply,
    validate_request,
    validate_vocab_mapping,
    weight_specs,
)
from spec_serve.transport.hostpool import RecyclingAllocator
from spec_serve.transport.ingress import Ingress
from spec_serve.telemetry.logs import event
from spec_serve.telemetry.metrics import CLIENT_INTEGRITY_FAILURES
from spec_serve.protocol.commands import (
    CLIENT_PORT_HINT,
    CLIENT_TAG,
    CONNECT_TIMEOUT,
    CONTROL_SLACK_BYTES,
    FRONTEND_PORT,
    HEARTBEAT_INTERVAL,
    HEARTBEAT_LIVENESS,
    ClientCommand,
    ErrorCode,
    Op,
    ProtocolError,
    Status,
    control,
    new_request_id,
    parse_control,
    parse_data,
)
from spec_serve.transport.sockets import (
    DEFAULT_MAX_MESSAGE_BYTES,
    KeyPolicy,
    Security,
    bound_endpoint,
    check_connect_url,
    make_socket,
    route_address,
)

log = logging.getLogger("spec_serve.client")

# Delay before retrying a request the broker could not place (e.g. its queue
# for us was full): short, so a transient condition costs little.
RETRY_BACKOFF_S = 0.2
# STATUS pages gathered at most (each holds up to 32 KiB of entries: far more than any real cluster).
MAX_STATUS_PAGES = 10_000
# Answered request ids remembered, so that a late second reply counts as a duplicate, not unknown.
RECENT_IDS = 4096


def _ipc_endpoint() -> str:
    return f"ipc://{os.environ.get('TMPDIR', '/tmp')}/spec-serve-{uuid.uuid4().hex}.sock"


class RemoteError(RuntimeError):
    """A worker or the broker failed a request: the worker's engine died serving it (never retried), or
    every attempt got an error reply. The message names the worker and the error."""


class IntegrityError(RemoteError):
    """A reply's bytes, as landed here, differed from the worker's digest twice (two attempts, two workers
    where the service has two)."""


class TargetChangedError(RemoteError):
    """The service now serves another target (fingerprint) than this client set up with."""


class _Received(dict):
    """A reply's tensors by name (frames: ``wire.TensorSpan``; NCCL: device tensors) with the worker's
    data-message header (``worker``, ``fingerprint``, ``digests``) and the request id."""

    def __init__(self, tensors: Mapping, header: dict, request_id: bytes):
        super().__init__(tensors)
        self.header = header
        self.request_id = request_id


class BrokerUnreachable(ConnectionError, TimeoutError):
    """No spec-serve broker answered at the client's address (or another kind of port did).

    A ``TimeoutError`` too, so code written for the older behaviour (every request timing out)
    still catches it.
    """


@dataclasses.dataclass
class _Pending:
    request_id: bytes
    command: bytes
    service: str
    header: dict[str, Any]
    payload: list
    future: concurrent.futures.Future
    timeout: float
    sent_at: float = 0.0
    attempts: int = 0
    not_before: float = 0.0
    max_retries: int | None = None  # None: the client's; BIND uses 0 (a resend could bind a second worker)
    expect: ReplySpecs | None = None  # what the reply must hold (contract.reply_specs); None: no tensors
    expect_bytes: int = 0


class _PendingTable(dict):
    """request id -> _Pending that keeps ``expected``, the bytes their replies may bring, and ``recent``,
    the last ``RECENT_IDS`` ids that left the table."""

    expected = 0

    def __init__(self):
        super().__init__()
        self.recent: "collections.OrderedDict[bytes, None]" = collections.OrderedDict()

    def __setitem__(self, request_id: bytes, pending: _Pending) -> None:
        self.pop(request_id, None)
        super().__setitem__(request_id, pending)
        self.expected += pending.expect_bytes

    def pop(self, request_id: bytes, *default):
        if request_id in self:
            self.expected -= self[request_id].expect_bytes
            self.recent[request_id] = None
            if len(self.recent) > RECENT_IDS:
                self.recent.popitem(last=False)
        return super().pop(request_id, *default)

    def clear(self) -> None:
        super().clear()
        self.expected = 0


@dataclasses.dataclass
class ClientStats:
    """Counts a run can report: what was sent, retried, dropped as duplicate."""

    sent: int = 0
    completed: int = 0
    retried: int = 0
    duplicates: int = 0  # a second reply to a request already answered
    unknown: int = 0  # replies to request ids this client never sent (or answered too long ago to remember)
    contract_violations: int = 0  # replies whose tensors broke the contract (retried)
    broker_reconnects: int = 0
    batched: int = 0  # replies computed in a forward shared with other requests (worker batching)
    nccl_batches: int = 0  # replies whose tensors came over the bound worker's pair group (no payload frames)
    nccl_fallbacks: int = 0  # bound requests re-sent as frames through the shared pool after a failure
    plane_replies: int = 0  # replies whose bytes a same-host worker lent through the plane (samehost.py)
    plane_fallbacks: int = 0  # of those, replies that could not be read there and were asked for again as frames
    digest_checks: int = 0  # replies whose landed bytes were checked against the worker's digests (verify=)
    digest_mismatches: int = 0  # of those, replies that differed: never returned, retried once on another worker
    target_mismatches: int = 0  # replies (or broker refusals) from another target than we set up with: failed


class _ClientIO(threading.Thread):
    """Owns the sockets; every other thread goes through ``submit``."""

    def __init__(self, broker_url: str, *, security: Security | None, advertise_host: str | None,
                 max_retries: int, heartbeat_interval: float, liveness: int, max_message_bytes: int,
                 device: torch.device, same_host_plane: bool | None = None,
                 connect_timeout: float = CONNECT_TIMEOUT):
        super().__init__(name="spec-serve-client-io", daemon=True)
        self.broker_url = check_connect_url(broker_url, CLIENT_PORT_HINT, FRONTEND_PORT)
        self.ctx = zmq.Context.instance()
        self.connect_timeout = connect_timeout
        self._created_at = time.monotonic()
        self._heard = False  # any valid message from the broker yet (on this or an earlier socket)
        self._lost_since: float | None = None  # broker silent past its liveness window, since when
        # Set while requests cannot reach a broker: new ones fail at once with it instead of waiting.
        self._unreachable: BrokerUnreachable | None = None
        self._misdirected = False  # the broker said we reached its workers' port
        self._watch: ConnectWatch | None = None
        self.security = security
        self.max_retries = max_retries
        self.heartbeat_interval = heartbeat_interval
        self.liveness = liveness
        self.max_message_bytes = max_message_bytes
        self.identity = uuid.uuid4().bytes
        self.stats = ClientStats()
        # CPU results spanning frames are assembled into reused buffers (fresh ones fault on every page).
        self.recv_alloc = RecyclingAllocator()
        self._inbox: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
        self._pending = _PendingTable()
        self.largest_reply = 0  # bytes of the largest reply expected so far (room for one late duplicate)
        self._closing = threading.Event()
        self._broker_instance: str | None = None
        self.binding = None  # spec_serve.transport.binding.ClientBinding when enable_nccl
        # digest -> (service, SET_VOCAB payload) of the mappings registered at the broker and not released:
        # the current one and any that pending requests name. Re-sent after a broker restart.
        self.vocab_registrations: dict[str, tuple[str, list]] = {}
        self.current_vocab: str | None = None
        self._ipc_files: list[str] = []
        self.data = self.dealer = self.data_ingress = None
        # Same-host workers lend GENERATE replies' bytes through memory we map (samehost.py); None: frames only.
        self.plane = samehost.ClientPlane.start(device, same_host_plane)
        self._wake_r, self._wake_w = os.pipe()
        try:
            os.set_blocking(self._wake_w, False)
            self._open_sockets(broker_url, security, advertise_host)
        except BaseException:
            self._release_resources()  # a constructor that raises leaks no descriptor
            raise

    def _open_sockets(self, broker_url: str, security: Security | None, advertise_host: str | None) -> None:
        # Where peers reach us: the data socket, and a bound worker's gloo connections (binding.py).
        self.local_host = "127.0.0.1" if broker_url.startswith("ipc://") else advertise_host or route_address(broker_url)
        if broker_url.startswith("ipc://"):
            data_bind = _ipc_endpoint()
        else:
            data_bind = f"tcp://{self.local_host}:*"
        # With CURVE, only the workers' keys may push replies here (none without worker_keys_dir).
        self.data_keys = KeyPolicy(security.worker_keys_dir) if security else None
        self.data = make_socket(self.ctx, zmq.PULL, security=security, admit=self.data_keys)
        # Workers may push at most the replies we wait for (and one late duplicate) before we see them whole.
        self.data_ingress = Ingress(self.data, "client.data", total=self._reply_room, bind=data_bind)
        self.data_endpoint = bound_endpoint(self.data)
        if data_bind.startswith("ipc://"):
            self._ipc_files.append(data_bind[len("ipc://"):])
        self.data_key = security.keypair()[0].decode() if security else None
        self.dealer = self._connect()

    def _release_resources(self) -> None:
        """Close the sockets and the wake-up pipe, and unlink our ipc socket files."""
        if self.data_ingress is not None:
            self.data_ingress.close()
        for sock in (self.dealer, self.data):
            if sock is not None:
                sock.close(0)
        for path in self._ipc_files:  # libzmq leaves a named ipc socket's file behind
            with contextlib.suppress(OSError):
                os.unlink(path)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _connect(self) -> zmq.Socket:
        sock = make_socket(self.ctx, zmq.DEALER, identity=self.identity, security=self.security)
        if self._heard:  # reached once: what went wrong since is a lost broker, not a wrong address
            sock.connect(self.broker_url)
            self._watch = None
        else:
            self._watch = connect_watched(sock, self.broker_url)
        return sock

    def _reply_room(self) -> int:
        """Bytes the data socket may hold undelivered (read by the ingress watcher thread)."""
        return self._pending.expected + self.largest_reply + CONTROL_SLACK_BYTES * (1 + len(self._pending))

    # ------------------------------------------------------ user-side entry

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the I/O thread."""
        if self._closing.is_set():
            raise RuntimeError("client is closed")
        self._inbox.put(fn)
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already

    def submit(self, command: ClientCommand, service: str, header: dict, payload: Sequence,
               timeout: float, request_id: bytes | None = None, max_retries: int | None = None,
               expect: ReplySpecs | None = None) -> concurrent.futures.Future:
        """Send a request; ``expect``: the tensors its reply must hold (checked before anything is allocated)."""
        pending = _Pending(request_id or new_request_id(), command.value, service, header, list(payload),
                           concurrent.futures.Future(), timeout, max_retries=max_retries, expect=expect,
                           expect_bytes=reply_bytes(expect) if expect else 0)
        self.call(lambda: self._send_new(pending))
        return pending.future

    def register_vocab(self, service: str, payload: list, header: dict, timeout: float) -> concurrent.futures.Future:
        """Register a mapping as the current one (SET_VOCAB with ``header``); a future of its digest.

        The same message releases our earlier registrations that no pending request names, so the
        broker keeps only live mappings however often the mapping changes.
        """
        digest: concurrent.futures.Future = concurrent.futures.Future()

        def send() -> None:
            named = {p.header.get("vocab") for p in self._pending.values()}
            release = [d for d in self.vocab_registrations if d not in named]
            for d in release:
                del self.vocab_registrations[d]
            pending = _Pending(new_request_id(), ClientCommand.SET_VOCAB.value, service,
                               dict(header, release=release), payload, concurrent.futures.Future(), timeout)
            pending.future.add_done_callback(lambda f: self._registered(f, service, payload, digest))
            self._send_new(pending)

        self.call(send)
        return digest

    def _registered(self, reply: concurrent.futures.Future, service: str, payload: list,
                    digest: concurrent.futures.Future) -> None:
        """I/O thread: record the VOCAB_OK's digest as the current mapping."""
        if reply.exception() is not None:
            digest.set_exception(reply.exception())
            return
        name = reply.result().header["digest"]
        self.vocab_registrations[name] = (service, payload)
        self.current_vocab = name
        digest.set_result(name)

    def _send_registration(self, digest: str | None) -> None:
        """Re-send the registration of ``digest`` (one we still hold) to the broker."""
        if digest in self.vocab_registrations:
            service, payload = self.vocab_registrations[digest]
            self._send(control(CLIENT_TAG, ClientCommand.SET_VOCAB.value, service, new_request_id(), {}, payload))

    def close(self) -> None:
        if self._closing.is_set():
            return
        # The I/O thread must send DISCONNECT before it stops, or the broker
        # counts this client (and what it queued) until its liveness expires.
        sent = threading.Event()
        self.call(lambda: (self._disconnect(), sent.set()))
        if self.is_alive():
            sent.wait(timeout=2)
        self._closing.set()
        self.join(timeout=5)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # ------------------------------------------------------------ I/O loop

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.dealer, zmq.POLLIN)
        poller.register(self.data, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_beat = 0.0
        broker_expiry = time.monotonic() + self.heartbeat_interval * self.liveness
        try:
            while not self._closing.is_set():
                events = dict(poller.poll(min(self.heartbeat_interval, 0.1) * 1000))
                now = time.monotonic()
                if self._wake_r in events:
                    os.read(self._wake_r, 4096)
                while True:
                    try:
                        self._inbox.get_nowait()()
                    except queue.Empty:
                        break
                if self.dealer in events:
                    broker_expiry = now + self.heartbeat_interval * self.liveness
                    self._drain(self.dealer, self._on_control)
                if self.data in events:
                    self._drain(self.data, self._on_data)
                if now >= next_beat and not self._misdirected:
                    self._send(control(CLIENT_TAG, ClientCommand.HEARTBEAT.value))
                    next_beat = now + self.heartbeat_interval
                    if self.plane is not None:
                        self.plane.tick()
                if now > broker_expiry:
                    broker_expiry = now + self.heartbeat_interval * self.liveness
                    if self._heard:  # never reached: libzmq keeps retrying the same socket
                        self._reconnect(poller, now)
                self._check_reached(now)
                self._check_timeouts(now)
        finally:
            for pending in self._pending.values():
                if not pending.future.done():
                    pending.future.set_exception(RuntimeError("client closed"))
            self._pending.clear()
            if self._watch is not None:
                self._watch.close()
            self.dealer.close(linger=500)  # let a final DISCONNECT leave
            self.data_ingress.close()
            self.data.close(0)
            for path in self._ipc_files:  # libzmq leaves a named ipc socket's file behind
                with contextlib.suppress(OSError):
                    os.unlink(path)
            if self.plane is not None:
                self.plane.close()

    def _reconnect(self, poller: zmq.Poller, now: float) -> None:
        """Lazy Pirate: the broker went silent; a fresh socket, and every outstanding request again."""
        if self._lost_since is None:  # one line per outage, not one per liveness window
            self._lost_since = now
            event(log, logging.WARNING, "client.broker_lost", broker=self.broker_url,
                  silent_s=round(self.heartbeat_interval * self.liveness, 1))
        poller.unregister(self.dealer)
        self.dealer.close(0)
        self.dealer = self._connect()
        poller.register(self.dealer, zmq.POLLIN)
        self.stats.broker_reconnects += 1
        self._resend_all()

    def _broker_answered(self) -> None:
        """A valid message from the broker: we are (again) connected."""
        if self._lost_since is not None:
            event(log, logging.WARNING, "client.broker_regained", broker=self.broker_url,
                  after_s=round(time.monotonic() - self._lost_since, 1))
            self._lost_since = None
        if self._unreachable is not None:
            event(log, logging.WARNING, "client.broker_reached", broker=self.broker_url)
            self._unreachable = None
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        self._heard = True

    def _check_reached(self, now: float) -> None:
        """Fail fast, naming the address and the likely cause, when no broker ever answered."""
        if self._heard or self._unreachable is not None:
            return
        self._watch.read()  # keep the monitor's queue short; cause() needs only what it saw
        if now - self._created_at > self.connect_timeout:
            self._fail_all(BrokerUnreachable(
                f"no spec-serve broker answered at {self.broker_url} within {self.connect_timeout:g}s: "
                f"{self._watch.cause()}. Clients connect to {CLIENT_PORT_HINT}"))

    def _fail_all(self, error: BrokerUnreachable) -> None:
        """Requests cannot reach a broker: fail those pending, and every new one at once, with ``error``."""
        if self._unreachable is None:
            event(log, logging.WARNING, "client.broker_unreachable", broker=self.broker_url, error=error)
        self._unreachable = error
        for pending in list(self._pending.values()):
            self._fail(pending, BrokerUnreachable(str(error)))

    def _drain(self, sock: zmq.Socket, handler) -> None:
        for _ in range(64):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if sock is self.data:
                self.data_ingress.delivered(frames)
            try:
                handler(frames)
            except (ProtocolError, wire.WireError) as e:
                event(log, logging.WARNING, "client.bad_message", error=e)
            except Exception as e:  # whatever a peer sends, the I/O thread must live on
                log.exception("client.handler_failed error=%s", e)

    def _send(self, frames: list) -> None:
        try:
            self.dealer.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            pass  # not connected or saturated: timeouts and heartbeats recover

    def _send_new(self, pending: _Pending) -> None:
        if self._unreachable is not None:
            pending.future.set_exception(BrokerUnreachable(str(self._unreachable)))
            return
        self.largest_reply = max(self.largest_reply, pending.expect_bytes)
        self._pending[pending.request_id] = pending
        self.stats.sent += 1
        self._transmit(pending, time.monotonic())

    def _transmit(self, pending: _Pending, now: float) -> None:
        pending.sent_at = now
        pending.attempts += 1
        self._send(control(CLIENT_TAG, pending.command, pending.service, pending.request_id, pending.header,
                           pending.payload))

    def _retry(self, pending: _Pending, now: float, reason: str, delay: float = 0.0,
               exhausted: type[Exception] = TimeoutError) -> None:
        """Send ``pending`` again, or fail it with ``exhausted`` (RemoteError after error replies) once
        its attempts are used up."""
        if pending.header.get("bound") is not None:
            # Whatever went wrong on the bound path (worker lost, group broken, timeout): the shared pool now.
            self.nccl_fallback(pending.request_id, reason)
            return
        limit = self.max_retries if pending.max_retries is None else pending.max_retries
        if pending.attempts > limit:
            self._fail(pending, exhausted(
                f"request {pending.request_id.hex()[:12]} to service {pending.service!r} failed after "
                f"{pending.attempts} attempts: {reason}"))
            return
        self.stats.retried += 1
        event(log, logging.INFO, "client.retry", request=pending.request_id.hex()[:12], reason=reason)
        if delay:
            pending.not_before = now + delay
            pending.sent_at = float("inf")
        else:
            self._transmit(pending, now)

    def _resend_all(self) -> None:
        now = time.monotonic()
        for digest in [d for d in self.vocab_registrations if d != self.current_vocab] + [self.current_vocab]:
            self._send_registration(digest)
        for pending in list(self._pending.values()):
            if pending.command == ClientCommand.BIND.value:
                # A binding half-made through a lost broker is void; the caller falls back to frames.
                self._fail(pending, RemoteError("broker lost or restarted during BIND"))
                continue
            # Not the request's fault: resending after a broker restart or loss
            # costs no attempt (a broker down for a while must not fail requests).
            if pending.command == ClientCommand.REQUEST.value:
                self.stats.retried += 1
            # The timeout clock keeps running from the last counted attempt, so a
            # broker that never comes back still fails the request (no hung rank).
            sent_at = pending.sent_at if pending.sent_at != float("inf") else now
            pending.not_before = 0.0
            self._transmit(pending, now)
            pending.attempts -= 1
            pending.sent_at = sent_at

    def _check_timeouts(self, now: float) -> None:
        for pending in list(self._pending.values()):
            if pending.not_before and now >= pending.not_before:
                pending.not_before = 0.0
                self._transmit(pending, now)
            elif now - pending.sent_at > pending.timeout:
                self._retry(pending, now, f"no reply within {pending.timeout:g}s")

    def _fail(self, pending: _Pending, exc: BaseException) -> None:
        self._pending.pop(pending.request_id, None)
        if not pending.future.done():
            pending.future.set_exception(exc)

    def _on_control(self, frames: list) -> None:
        msg = parse_control(frames, CLIENT_TAG, ClientCommand)
        command = ClientCommand(msg.command)
        if command is ClientCommand.ERROR and msg.header.get("code") == ErrorCode.WRONG_PORT.value:
            self._misdirected = True  # no use heartbeating a port that only says so again
            self._fail_all(BrokerUnreachable(f"{self.broker_url}: {msg.header.get('error')}"))
            return
        self._broker_answered()
        if command is ClientCommand.HEARTBEAT:
            instance = msg.header.get("broker")
            if self._broker_instance is not None and instance != self._broker_instance:
                event(log, logging.WARNING, "client.broker_restarted", broker=self.broker_url)
                self._broker_instance = instance
                self._resend_all()
            self._broker_instance = instance
            return
        pending = self._pending.get(msg.request_id)
        if command is ClientCommand.BOUND and msg.header.get("lost") and self.binding is not None:
            # The bound worker died or re-registered (a pending BIND resolves below as a refusal).
            self.binding.lost(msg.header.get("prefix"), str(msg.header.get("error")))
        if pending is None:
            return
        now = time.monotonic()
        if command is ClientCommand.ERROR:
            code, error = msg.header.get("code"), str(msg.header.get("error"))
            if msg.header.get("unknown_vocab") and pending.header.get("vocab") in self.vocab_registrations:
                self._send_registration(pending.header["vocab"])  # e.g. a restarted broker lacks it
                self._retry(pending, now, error, delay=RETRY_BACKOFF_S)
            elif code in (ErrorCode.TIMEOUT.value, ErrorCode.UNAVAILABLE.value, ErrorCode.INTERNAL.value):
                self._retry(pending, now, error, delay=RETRY_BACKOFF_S,
                            exhausted=TimeoutError if code == ErrorCode.TIMEOUT.value else RemoteError)
            elif code == ErrorCode.TARGET_CHANGED.value:
                self._target_changed(pending, error, worker=None)
            elif code == ErrorCode.KILLED_WORKERS.value:
                self._fail(pending, RemoteError(error))
            else:
                self._fail(pending, ValueError(error))
            return
        self._pending.pop(msg.request_id)
        self.stats.completed += 1
        pending.future.set_result(msg)

    def _on_data(self, frames: list) -> None:
        status, request_id, header, payload = parse_data(frames)
        pending = self._pending.get(request_id)
        lent = header.get("plane") if status is Status.OK else None
        if status is Status.OK and header.get("nccl"):
            # Tensors follow on the pair group: receive them even for a request already answered,
            # or the worker's send (and the group) stalls. No live binding: re-send as frames.
            expect = pending.expect if pending is not None else None
            if self.binding is None or not self.binding.on_metadata(request_id, header, expect, self.largest_reply):
                self.nccl_fallback(request_id, f"nccl reply from worker {header.get('worker')} without a live binding",
                                   prefix=str(header.get("pair")))
            return
        if pending is None or (status is Status.OK and not self._same_target(pending, header)):
            if pending is None:
                self._count_stray(request_id)
            self._give_back(lent)  # answered already, or not ours to use: the slot goes back unread
            return
        if status is Status.OK and pending.command == ClientCommand.BIND.value:
            self._pending.pop(request_id)
            self.stats.completed += 1
            pending.future.set_result(header)  # {"bind": {store_host, store_port, prefix, worker, timeout}}
            return
        if status is Status.ERROR:
            code, error = header.get("code"), f"worker {header.get('worker')}: {header.get('error')}"
            if code == ErrorCode.BAD_REQUEST.value:
                self._fail(pending, ValueError(error))
            elif code == ErrorCode.ENGINE_DEAD.value:  # not retried: this request may be what killed it
                self._fail(pending, RemoteError(f"{error} (its engine died serving this request; the worker "
                                                f"left the pool)"))
            else:
                self._retry(pending, time.monotonic(), error, delay=RETRY_BACKOFF_S, exhausted=RemoteError)
            return
        size = sum(len(memoryview(f)) for f in payload) + samehost.lent_bytes(lent)
        if size > self.max_message_bytes:  # an honest worker refuses this itself (max_reply_bytes)
            self._give_back(lent)
            self._fail(pending, ValueError(f"reply of {size} bytes from worker {header.get('worker')} exceeds this "
                                           f"client's max_message_bytes of {self.max_message_bytes}"))
            return
        if lent is not None:
            reply = self._open_lent(pending, header, payload)
            if reply is None:
                return
        else:  # checked here; the bytes stay in the frames until copied to where the caller wants them (_assemble)
            reply = _Received(wire.parse(payload, max_bytes=self.max_message_bytes)[0], header, request_id)
        if pending.expect is not None:
            try:  # before anything is allocated for the reply
                validate_reply({name: (span.dtype, span.shape) for name, span in reply.items()}, pending.expect)
            except ValueError as e:
                samehost.release_reply(reply)
                self.stats.contract_violations += 1
                event(log, logging.WARNING, "client.bad_reply", worker=header.get("worker"), error=e)
                self._retry(pending, time.monotonic(), f"worker {header.get('worker')}: {e}", delay=RETRY_BACKOFF_S)
                return
        self._pending.pop(request_id)
        self.stats.completed += 1
        if int(header.get("batched", 1)) > 1:
            self.stats.batched += 1
        pending.future.set_result(reply)

    def _same_target(self, pending: _Pending, header: dict) -> bool:
        """True if the reply comes from the target the request was pinned to (its ``fingerprint``);
        else the request fails and the reply is dropped."""
        expected, got = pending.header.get("fingerprint"), header.get("fingerprint")
        if expected is None or got == expected:
            return True
        self._target_changed(pending, f"worker {header.get('worker')} of service {pending.service!r} serves target "
                             f"fingerprint {got}, but this client set up with {expected}: its reply was discarded; "
                             f"start a new client to use the new target", worker=header.get("worker"))
        return False

    def _target_changed(self, pending: _Pending, message: str, worker) -> None:
        self.stats.target_mismatches += 1
        CLIENT_INTEGRITY_FAILURES.labels(service=pending.service, check="fingerprint").inc()
        event(log, logging.ERROR, "client.target_changed", request=pending.request_id.hex()[:12], worker=worker,
              error=message)
        self._fail(pending, TargetChangedError(message))

    def _open_lent(self, pending: _Pending, header: dict, payload: list) -> "samehost.PlaneReply | None":
        """A reply whose bytes a same-host worker lent, as the slot's spans (``_assemble`` copies them out, then
        settles); None if the plane cannot deliver it here, and it was asked for again as frames."""
        try:
            if self.plane is None:
                raise samehost.PlaneError("this client does not use the same-host plane")
            reply = self.plane.open(header, payload, pending.request_id,
                                    lambda reason: self._resend_as_frames(pending, reason))
        except samehost.PlaneError as e:
            self._give_back(header.get("plane"))
            if self.plane is not None:
                self.plane.failed(e)
            self._plane_fallback(pending, str(e))
            return None
        self.stats.plane_replies += 1
        return reply

    def _give_back(self, lent) -> None:
        """A lent reply that will not be read: its slot goes back to the worker now."""
        if lent is not None and self.plane is not None:
            self.plane.release(lent)

    def _plane_fallback(self, pending: _Pending, reason: str) -> None:
        """I/O thread: send a request again, as frames."""
        self._count_fallback(pending, reason)
        pending.header = {k: v for k, v in pending.header.items() if k != "plane"}
        pending.not_before = 0.0
        self._transmit(pending, time.monotonic())
        pending.attempts -= 1  # not the request's fault

    def _resend_as_frames(self, pending: _Pending, reason: str) -> concurrent.futures.Future:
        """Any thread: a lent reply's bytes were overwritten while we copied them: the request again, as frames."""
        again = dataclasses.replace(pending, request_id=new_request_id(), future=concurrent.futures.Future(),
                                    header={k: v for k, v in pending.header.items() if k != "plane"},
                                    sent_at=0.0, attempts=0, not_before=0.0)
        self.call(lambda: (self._count_fallback(again, reason), self._send_new(again)))
        return again.future

    def _count_fallback(self, pending: _Pending, reason: str) -> None:
        self.stats.plane_fallbacks += 1
        event(log, logging.INFO, "client.plane_fallback", request=pending.request_id.hex()[:12], reason=reason)

    def _count_stray(self, request_id: bytes) -> None:
        """A reply with no pending request: a late second answer, or an id we never sent."""
        if request_id in self._pending.recent:
            self.stats.duplicates += 1
        else:
            self.stats.unknown += 1
            event(log, logging.WARNING, "client.unknown_reply", request=request_id.hex()[:12])

    def _disconnect(self) -> None:
        self._send(control(CLIENT_TAG, ClientCommand.DISCONNECT.value))

    # ------------------------------------------- NCCL data plane (binding.py)

    def send_control(self, frames: list) -> None:
        self._send(frames)

    def nccl_resolve(self, request_id: bytes, tensors: dict, header: dict) -> None:
        """I/O thread: the pair thread received a bound request's tensors (``header``: its metadata message)."""
        pending = self._pending.get(request_id)
        if pending is None or pending.future.done():
            self._pending.pop(request_id, None)
            self._count_stray(request_id)
            return
        if not self._same_target(pending, header):
            return
        self._pending.pop(request_id)
        self.stats.completed += 1
        self.stats.nccl_batches += 1
        pending.future.set_result(_Received(tensors, header, request_id))

    def nccl_fallback(self, request_id: bytes, reason: str, prefix: str | None = None) -> None:
        """I/O thread: re-send a bound request as a plain one (frames, shared pool) and drop the binding."""
        if self.binding is not None:
            self.binding.mark_broken(reason, prefix)
        from spec_serve.transport.binding import BOUND_KEYS

        pending = self._pending.get(request_id)
        if pending is None or not any(k in pending.header for k in BOUND_KEYS):
            return

        pending.header = {k: v for k, v in pending.header.items() if k not in BOUND_KEYS}
        self.stats.nccl_fallbacks += 1
        event(log, logging.INFO, "client.nccl_request_fallback", request=request_id.hex()[:12], reason=reason)
        pending.not_before = 0.0
        self._transmit(pending, time.monotonic())
        pending.attempts -= 1  # not the request's fault


class RemoteTargetModel:
    """A frozen target served by spec-serve workers, with the colocated ``HFTarget`` surface.

    >>> target = RemoteTargetModel("tcp://broker:5555", num_shards=2, prefetch_depth=2)
    >>> target.set_vocab_mapping(selected_token_ids, selected_token_mask)
    >>> batch = target.generate_batch(input_ids, attention_mask, loss_mask, kind="eagle3")
    """

    def __init__(
        self,
        broker_url: str,
        *,
        service: str = "default",
        device: str | torch.device = "cpu",
        timeout: float = 120.0,
        max_retries: int = 3,
        prefetch_depth: int = 1,
        num_shards: int = 1,
        security: Security | None = None,
        advertise_host: str | None = None,
        heartbeat_interval: float = HEARTBEAT_INTERVAL,
        liveness: int = HEARTBEAT_LIVENESS,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        compact: bool = False,
        enable_nccl: bool = False,
        nccl_timeout: float = 30.0,
        nccl_retry_s: float = 30.0,
        same_host_plane: bool | None = None,
        verify: str | None = None,
        connect_timeout: float | None = None,
    ):
        if prefetch_depth < 1 or num_shards < 1 or max_retries < 0 or timeout <= 0:
            raise ValueError("prefetch_depth and num_shards must be >= 1, max_retries >= 0, timeout > 0")
        if enable_nccl and security is not None:
            raise ValueError("enable_nccl=True cannot be combined with CURVE security: the NCCL rendezvous "
                             "(TCPStore, gloo/NCCL connections) is not authenticated; use frames "
                             "(enable_nccl=False), which travel over CURVE")
        connect_timeout = CONNECT_TIMEOUT if connect_timeout is None else float(connect_timeout)
        if connect_timeout <= 0:
            raise ValueError("connect_timeout must be > 0")
        # End-to-end check of reply bytes (spec_serve/protocol/digest.py): "all" (default), "sampled", "off".
        self._sampler = digest.Sampler(digest.parse_verify(verify))
        self.service = service
        self.device = torch.device(device)
        self.timeout = float(timeout)
        self.num_shards = num_shards
        self.prefetch_depth = prefetch_depth
        self._credits = threading.BoundedSemaphore(prefetch_depth)
        self._io = _ClientIO(broker_url, security=security, advertise_host=advertise_host, max_retries=max_retries,
                             heartbeat_interval=heartbeat_interval, liveness=liveness,
                             max_message_bytes=max_message_bytes, device=self.device,
                             same_host_plane=same_host_plane, connect_timeout=connect_timeout)
        self._io.start()
        try:
            self._setup(compact, enable_nccl, nccl_timeout, nccl_retry_s)
        except BaseException:
            self._io.close()  # a constructor that raises leaks no thread or descriptor
            raise

    def _setup(self, compact: bool, enable_nccl: bool, nccl_timeout: float, nccl_retry_s: float) -> None:
        self._vocab_digest: str | None = None
        # The largest request payload the broker and this service's workers accept (learnt from STATUS).
        self._max_request_bytes: int | None = None
        self._draft_vocab: int | None = None
        self._info: TargetInfo | None = None
        self._fingerprint: str | None = None  # of the target we set up with; every reply must match it
        self._closed = False
        # Compact EAGLE-3: workers ship last hidden state + argmax; target_probs and position_mask
        # are rebuilt here from the draft-vocab lm_head slice, cached per mapping digest on `device`.
        self.compact = bool(compact)
        self._lm_head_slices: dict[str, torch.Tensor] = {}
        self._selected_mask: torch.Tensor | None = None
        # Expansion runs off the I/O thread (a [B*S,H]x[H,Vd] GEMM must not stall sockets).
        # Its thread makes `device` current, as the caller's thread would (else cuBLAS warns of no context).
        self._expander = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="spec-serve-expand",
            initializer=torch.cuda.set_device if self.device.type == "cuda" else None,
            initargs=(self.device,) if self.device.type == "cuda" else ()) if self.compact else None
        # NCCL data plane (docs/nccl.md): a worker of our own, tensors over a private 2-rank group
        # (NCCL on CUDA, gloo on CPU). Bound lazily by generate calls; every failure falls back to frames.
        self._binding = None
        if enable_nccl:
            from spec_serve.transport.binding import ClientBinding

            self._binding = self._io.binding = ClientBinding(self._io, self.service, self.device,
                                                             float(nccl_timeout), float(nccl_retry_s))

    @property
    def stats(self) -> ClientStats:
        return self._io.stats

    @property
    def verify(self) -> str:
        """How replies are checked end to end: "all", "sampled" (1 request in ``digest.SAMPLE_EVERY``) or "off"."""
        return self._sampler.mode

    @property
    def bound_worker(self) -> str | None:
        """Id of the worker bound to this client (enable_nccl), or None while frames are used."""
        return self._binding.worker if self._binding is not None else None

    def rebind(self) -> str | None:
        """Drop the binding (if any) and ask for a worker of our own now; returns its id or None."""
        if self._binding is None:
            raise RuntimeError("rebind() needs enable_nccl=True")
        self.target_info()
        return self._binding.rebind()

    # ---------------------------------------------------------- supervision

    def generate_batch(self, input_ids, attention_mask, loss_mask, kind: str = "eagle3") -> dict[str, torch.Tensor]:
        """Supervision for one ``[B, S]`` batch; the contract's tensors on ``device``."""
        return self.generate_batch_async(input_ids, attention_mask, loss_mask, kind).result()

    def generate_batch_async(self, input_ids, attention_mask, loss_mask,
                             kind: str = "eagle3") -> concurrent.futures.Future:
        """Submit a batch; blocks while ``prefetch_depth`` batches are already in flight."""
        kind = Kind.parse(kind)
        info = self.target_info()
        validate_request(input_ids, attention_mask, loss_mask, info.vocab_size)
        expand = self.compact and kind is Kind.EAGLE3
        wire_kind = Kind.EAGLE3_COMPACT if expand else kind
        if kind is not Kind.DSPARK and self._vocab_digest is None:
            raise RuntimeError("EAGLE-3 supervision needs a draft-vocab mapping: call set_vocab_mapping first")
        bound = self._binding.ensure() if self._binding is not None else None
        self._credits.acquire()
        try:
            bounds = shard_bounds(input_ids.shape[0], self.num_shards)
            requests, expects = [], []
            for lo, hi in bounds:
                # Copies, not views: the frames are sent later by the I/O thread, and again on a retry or
                # after a broker restart, while the caller may already refill its input tensors.
                payload = wire.encode({
                    "input_ids": input_ids[lo:hi].to("cpu", copy=True),
                    "attention_mask": attention_mask[lo:hi].to("cpu", copy=True),
                    "loss_mask": loss_mask[lo:hi].to("cpu", copy=True),
                })
                self._check_request_size(payload, f"request for rows {lo}:{hi}")
                header = {"op": Op.GENERATE.value, "kind": wire_kind.value, "timeout": self.timeout,
                          "tokens": int(attention_mask[lo:hi].sum())}
                if bound is not None:  # every shard to our bound worker; tensors over the pair group
                    header.update(bound=bound, nccl=True)
                elif self._io.plane is not None and (offer := self._io.plane.offer()) is not None:
                    header["plane"] = offer  # a worker of our host may lend the reply's bytes (samehost.py)
                requests.append((self._prepare(header), payload))
                expects.append(reply_specs(wire_kind, info, hi - lo, input_ids.shape[1], loss_mask.dtype,
                                           self._draft_vocab))
            shards = [self._submit(header, payload, expect) for (header, payload), expect in zip(requests, expects)]
        except BaseException:
            self._credits.release()
            raise
        result = _assemble(shards, [hi - lo for lo, hi in bounds], self.device, self._io.recv_alloc,
                           self._checker(requests, expects))
        if expand:
            result = self._expand_later(result, self._vocab_digest)
        result.add_done_callback(lambda _: self._credits.release())
        return result

    def _expand_later(self, compact: concurrent.futures.Future, digest: str) -> concurrent.futures.Future:
        """A future of the EAGLE-3 tensors rebuilt from a compact batch (after gathering every shard,
        so the draft-vocab GEMM has the colocated shape)."""
        from spec_serve.supervision.eagle3 import expand_compact

        out: concurrent.futures.Future = concurrent.futures.Future()
        weight, mask = self._lm_head_slices[digest], self._selected_mask

        def run():
            try:
                expanded = expand_compact(compact.result(), weight, mask)
                if self.device.type == "cuda":  # resolved means complete, as for frames and NCCL replies,
                    torch.cuda.current_stream(self.device).synchronize()  # whichever stream reads it
                out.set_result(expanded)
            except BaseException as e:
                out.set_exception(e)

        compact.add_done_callback(lambda _: self._expander.submit(run))
        return out

    def lm_head_slice(self) -> torch.Tensor:
        """The draft-vocab rows ``[Vd, H]`` of the target's lm_head for the current mapping, on ``device``:
        fetched from a worker once per mapping digest, then cached."""
        digest = self._vocab_digest
        if digest is None:
            raise RuntimeError("call set_vocab_mapping first")
        weight = self._lm_head_slices.get(digest)
        if weight is None:
            reply = self._fetch({"op": Op.LM_HEAD_SLICE.value, "timeout": self.timeout},
                                weight_specs(self.target_info(), self._draft_vocab))
            weight = self._lm_head_slices[digest] = reply["weight"]
        return weight

    def _fetch(self, header: dict, expect: ReplySpecs) -> dict[str, torch.Tensor]:
        """A request without payload (embeddings, lm_head slice): its tensors on ``device``, checked like a batch."""
        self.target_info()  # pins the target every reply must come from
        requests = [(self._prepare(header), [])]
        return _assemble([self._submit(*requests[0], expect)], [0], self.device, None,
                         self._checker(requests, [expect])).result()

    def _check_request_size(self, payload: Sequence, what: str) -> None:
        """Refuse a payload over what the broker or this service's workers accept, before sending it
        (ZeroMQ would drop the connection on it, and nothing would answer)."""
        self.target_info()  # learns the limit
        size = sum(len(memoryview(f)) for f in payload)
        if self._max_request_bytes is not None and size > self._max_request_bytes:
            raise ValueError(f"{what} is {size} bytes, over the max message size of {self._max_request_bytes} "
                             f"bytes of service {self.service!r} (broker --max-message-bytes, or its workers'): "
                             f"send fewer rows per request (num_shards) or raise the limit")

    def _prepare(self, header: dict) -> dict:
        """``header`` with what every request carries: where to reply, the vocab mapping, the target we set
        up with (``fingerprint``, once ``target_info`` ran), whether to digest the reply (``verify``), and
        the largest reply we take (``max_reply_bytes``: the worker refuses a bigger one instead of sending
        it, and computing it again on every retry)."""
        security = self._io.security
        if security is not None and security.worker_keys_dir is None:
            raise ValueError("with CURVE this client's data socket admits only workers' keys: give "
                             "Security(worker_keys_dir=...), the directory the broker admits workers from")
        header = dict(header, reply_to=self._io.data_endpoint, max_reply_bytes=self._io.max_message_bytes)
        if self._fingerprint is not None:
            header["fingerprint"] = self._fingerprint
        bound = self._binding.worker if self._binding is not None else None
        if bound is not None:  # embeddings, lm_head slices: our own worker too (as frames), not the pool
            header.setdefault("bound", bound)
        if self._vocab_digest is not None:
            header.setdefault("vocab", self._vocab_digest)
        if self._io.data_key:
            header["data_key"] = self._io.data_key
        if self._sampler.wants():
            header["verify"] = True
        return header

    def _submit(self, header: dict, payload: Sequence, expect: ReplySpecs | None = None) -> concurrent.futures.Future:
        """Send a prepared request; ``expect``: the tensors its reply must hold (``contract.reply_specs``)."""
        return self._io.submit(ClientCommand.REQUEST, self.service, header, payload, self.timeout, expect=expect)

    def _checker(self, requests: list[tuple[dict, Sequence]], expects: list[ReplySpecs]) -> Callable:
        """``check(k, reply, landed)`` for ``_assemble``: None accepts request ``k``'s landed tensors; a
        mismatch with the worker's digests returns the future of one retry on another worker (the
        worker is named in ``avoid``; a bound request goes back to the pool as frames), and a second
        mismatch raises ``IntegrityError``. Runs on the I/O thread."""
        retried: dict[int, str] = {}  # request index -> the worker whose reply mismatched first

        def check(k: int, reply: _Received, landed: Mapping[str, torch.Tensor]):
            header, payload = requests[k]
            if not header.get("verify"):
                return None
            self._io.stats.digest_checks += 1
            bad = digest.mismatches(reply.header.get("digests"), landed)
            if not bad:
                return None
            worker = str(reply.header.get("worker"))
            self._io.stats.digest_mismatches += 1
            CLIENT_INTEGRITY_FAILURES.labels(service=self.service, check="digest").inc()
            event(log, logging.ERROR, "client.digest_mismatch", request=reply.request_id.hex()[:12], worker=worker,
                  tensors=",".join(bad), retry=k not in retried)
            if k in retried:
                raise IntegrityError(f"reply to request {reply.request_id.hex()[:12]} differs from its worker's "
                                     f"digest in {', '.join(bad)} on the retry too (first from worker {retried[k]}, "
                                     f"then from worker {worker}): the bytes change between the worker's device "
                                     f"and ours; see the ERROR lines client.digest_mismatch")
            retried[k] = worker
            if header.get("nccl") and self._binding is not None:
                self._binding.mark_broken(f"digest mismatch in a reply from worker {worker}")
            from spec_serve.transport.binding import BOUND_KEYS

            retry = {key: v for key, v in header.items() if key not in BOUND_KEYS}
            retry["avoid"] = worker
            requests[k] = (retry, payload)
            return self._submit(retry, payload, expects[k])

        return check

    def set_vocab_mapping(self, selected_token_ids: torch.Tensor, selected_token_mask: torch.Tensor) -> None:
        """Register the draft vocab; every later EAGLE-3 request is served with exactly it."""
        ids = selected_token_ids.to("cpu", torch.int64).contiguous()
        mask = selected_token_mask.to("cpu", torch.bool).contiguous()
        validate_vocab_mapping(ids, mask, self.target_info().vocab_size)
        payload = [bytes(memoryview(f)) for f in wire.encode({"selected_token_ids": ids, "selected_token_mask": mask})]
        self._check_request_size(payload, "the vocab mapping")
        digest = self._io.register_vocab(self.service, payload, {"fingerprint": self._fingerprint},
                                         self.timeout).result()
        self._vocab_digest = digest
        self._draft_vocab = ids.numel()
        self._selected_mask = mask.to(self.device)
        if self.compact:
            self.lm_head_slice()

    # ----------------------------------------------------------- target info

    def status(self, service: str | None = None) -> dict[str, Any]:
        """The broker's view: services, workers, queues (of one ``service``, or all). The broker answers in
        pages of bounded size; this gathers them all."""
        query: dict[str, Any] = {} if service is None else {"service": service}
        pages = 0
        while True:
            page = self._io.submit(ClientCommand.STATUS, self.service, query, (), self.timeout).result().header
            if pages == 0:
                status = dict(page, services={}, workers=[])
            status["services"].update(page.get("services", {}))
            status["workers"].extend(page.get("workers", []))
            pages += 1
            cursor = page.get("next")
            if cursor is None:
                status.pop("next", None)
                return status
            if cursor == query.get("after") or pages > MAX_STATUS_PAGES:
                raise RemoteError(f"broker STATUS pages do not end (page {pages}, cursor {cursor!r})")
            query["after"] = cursor

    def _worker_infos(self, wait: bool = True) -> dict[str, dict]:
        """Target info of this service's workers, waiting for one to register: up to ``timeout`` for a
        service that has had workers (they may be restarting), up to the broker's unknown-service grace
        (SPEC_SERVE_UNKNOWN_SERVICE_GRACE) for one that never had any (a ValueError listing those that do)."""
        started = time.monotonic()
        while True:
            status = self.status(self.service)
            workers = [w for w in status["workers"] if w["service"] == self.service]
            limits = [status.get("max_message_bytes")] + [w.get("max_message_bytes") for w in workers]
            limits = [n for n in limits if isinstance(n, int) and n > 0]
            self._max_request_bytes = min(limits) if limits else None
            infos = {w["id"]: w["target_info"] for w in workers}
            if infos or not wait:
                return infos
            waited = time.monotonic() - started
            never_served = not (status["services"].get(self.service) or {}).get("ever_had_workers")
            grace = status.get("unknown_service_grace_s")
            if never_served and grace is not None and waited > grace:
                served = sorted(name for name, s in self.status()["services"].items() if s["workers"])
                raise ValueError(f"unknown service {self.service!r}: no worker has registered for it within "
                                 f"{grace:g}s (SPEC_SERVE_UNKNOWN_SERVICE_GRACE on the broker); services with "
                                 f"workers: {served}")
            if waited > self.timeout:
                raise TimeoutError(f"no worker registered for service {self.service!r} within {self.timeout:g}s")
            time.sleep(0.2)

    def target_info(self) -> TargetInfo:
        """What this service's workers serve (they must agree; engines may differ)."""
        if self._info is None:
            infos = self._worker_infos()
            first_id, first = next(iter(infos.items()))
            reference = TargetInfo.from_dict(first)
            for worker, info in infos.items():
                diff = reference.mismatches(info, ignore=("engine",))
                if diff:
                    raise ValueError(_mismatch_message(f"workers {first_id} and {worker} of service "
                                                       f"{self.service!r} disagree", diff, "first", "other"))
            if self._fingerprint not in (None, reference.fingerprint):
                raise TargetChangedError(f"service {self.service!r} now serves target fingerprint "
                                         f"{reference.fingerprint} (worker {first_id}), but this client set up with "
                                         f"{self._fingerprint}: start a new client to use the new target")
            self._fingerprint = reference.fingerprint
            self._info = reference
        return self._info

    def check_target_info(self, expected: TargetInfo | Mapping[str, Any]) -> None:
        """Raise ``ValueError`` naming the worker and fields that differ from ``expected``."""
        self._info = None
        self.target_info()  # workers agree with each other
        for worker, info in self._worker_infos().items():
            diff = TargetInfo.from_dict(info).mismatches(expected)
            if diff:
                raise ValueError(_mismatch_message(f"worker {worker} of service {self.service!r} serves a "
                                                   f"different target", diff, "worker", "expected"))

    def get_input_embeddings(self) -> types.SimpleNamespace:
        """The target's input embedding as ``.weight`` ``[V, H]`` on ``device``."""
        return self._embeddings("input")

    def get_output_embeddings(self) -> types.SimpleNamespace:
        """The target's lm_head as ``.weight`` ``[V, H]`` (tied models: the embedding)."""
        return self._embeddings("output")

    def _embeddings(self, which: str) -> types.SimpleNamespace:
        info = self.target_info()
        reply = self._fetch({"op": Op.EMBEDDINGS.value, "which": which, "timeout": self.timeout},
                            weight_specs(info, info.vocab_size))
        return types.SimpleNamespace(weight=reply["weight"])

    # ------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Leave the broker; workers and other clients carry on."""
        if not self._closed:
            self._closed = True
            if self._binding is not None:
                self._binding.close()  # RELEASE goes out before the DISCONNECT
            self._io.close()
            if self._expander is not None:
                self._expander.shutdown(wait=False)

    def __enter__(self) -> "RemoteTargetModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def shard_bounds(rows: int, num_shards: int) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` row ranges a batch of ``rows`` rows is sent as: ``num_shards`` near-equal parts."""
    return [(int(c[0]), int(c[-1]) + 1) for c in torch.arange(rows).tensor_split(min(num_shards, rows))]


Reply = Mapping[str, "wire.TensorSpan | torch.Tensor"]  # frames replies: spans; NCCL replies: device tensors


def _materialize(reply: Reply, device: torch.device, alloc: Callable[[int], torch.Tensor] | None = None,
                 ) -> dict[str, torch.Tensor]:
    """A reply's tensors on ``device``: a frame's bytes go straight there (no host staging copy); a
    single-frame CPU tensor stays a zero-copy view of its frame."""
    out = {}
    for name, part in reply.items():
        if isinstance(part, torch.Tensor):
            out[name] = part.to(device)
            continue
        t = part.view() if device.type == "cpu" else None
        if t is None:
            t = part.copy_into(_byte_buffer(part.nbytes, device, alloc))
        out[name] = t
    return out


def _assemble(shards: list[concurrent.futures.Future], rows: list[int], device: torch.device,
              alloc: Callable[[int], torch.Tensor] | None, check: Callable | None = None) -> concurrent.futures.Future:
    """One future for a batch sent as ``len(shards)`` row ranges of ``rows`` rows each.

    As each shard's reply arrives (on the I/O thread, while ZeroMQ keeps receiving the others) its
    bytes are copied into its rows of tensors allocated once, on ``device``: no per-shard host
    tensors and no concatenation. A shard whose tensors do not fit the others' fails the batch.
    ``check(k, reply, landed)`` then sees shard ``k``'s tensors as landed: None accepts them, a future
    (a retry) is waited for instead and lands on the same rows, an exception fails the batch.
    A shard lent through the same-host plane is settled first, once copied: its slot goes back to the
    worker, and if the worker reused the slot meanwhile the shard is asked for again (frames), likewise.
    """
    out: concurrent.futures.Future = concurrent.futures.Future()
    starts = [sum(rows[:k]) for k in range(len(rows))]
    lock = threading.Lock()
    state: dict[str, Any] = {"tensors": None, "left": len(shards)}

    def land(k: int, reply: Reply) -> dict[str, torch.Tensor]:
        if len(shards) == 1:
            return _materialize(reply, device, alloc)
        if state["tensors"] is None:
            state["tensors"] = _allocate_rows(reply, sum(rows), device, alloc)
        _copy_rows(reply, state["tensors"], starts[k], rows[k], device)
        return {name: t[starts[k] : starts[k] + rows[k]] for name, t in state["tensors"].items()}

    def arrived(k: int, future: concurrent.futures.Future) -> None:
        retry = None
        with lock:
            try:
                if not out.done():
                    reply = future.result()
                    landed = land(k, reply)
                    retry = samehost.settle(reply)  # a lent reply's slot back; a retry if it was reused meanwhile
                    if retry is None and check is not None:
                        retry = check(k, reply, landed)
                    if retry is None:
                        state["left"] -= 1
                        if not state["left"]:
                            out.set_result(landed if len(shards) == 1 else state["tensors"])
            except BaseException as e:
                out.set_exception(e)
            finally:
                samehost.release(future)  # a lent reply not settled above (the batch failed): its slot back
        if retry is not None:
            retry.add_done_callback(lambda f: arrived(k, f))

    for k, f in enumerate(shards):
        f.add_done_callback(lambda f, k=k: arrived(k, f))
    return out


def _allocate_rows(reply: Reply, total_rows: int, device: torch.device,
                   alloc: Callable[[int], torch.Tensor]) -> dict[str, torch.Tensor]:
    tensors = {}
    for name, part in reply.items():
        if len(part.shape) == 0:
            raise RemoteError(f"sharded reply tensor {name!r} has no batch dimension")
        shape = (total_rows, *part.shape[1:])
        nbytes = math.prod(shape) * part.dtype.itemsize
        tensors[name] = _byte_buffer(nbytes, device, alloc).view(part.dtype).view(shape)
    return tensors


def _byte_buffer(nbytes: int, device: torch.device, alloc: Callable[[int], torch.Tensor] | None) -> torch.Tensor:
    """``nbytes`` uint8 on ``device`` for a reply tensor: recycled on the CPU (fresh large buffers fault
    on every page), from the caching allocator on a GPU."""
    if device.type == "cpu" and alloc is not None:
        return alloc(nbytes)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _copy_rows(reply: Reply, tensors: dict[str, torch.Tensor], lo: int, n: int, device: torch.device) -> None:
    if reply.keys() != tensors.keys():
        raise RemoteError(f"shards disagree on reply tensors: {sorted(reply)} vs {sorted(tensors)}")
    for name, part in reply.items():
        dst = tensors[name]
        if part.dtype != dst.dtype or tuple(part.shape) != (n, *dst.shape[1:]):
            raise RemoteError(f"shard tensor {name!r} is {part.dtype}{list(part.shape)}, expected "
                              f"{dst.dtype}{[n, *dst.shape[1:]]}")
        rows = dst[lo : lo + n]
        if isinstance(part, torch.Tensor):
            rows.copy_(part)
        else:
            part.copy_into(rows.view(-1).view(torch.uint8))


def _mismatch_message(title: str, diff: dict, ours: str, theirs: str) -> str:
    fields = "; ".join(f"{k}: {ours}={a!r} {theirs}={b!r}" for k, (a, b) in diff.items())
    return f"{title}: {fields}"
