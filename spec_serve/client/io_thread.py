"""The client's I/O thread: it alone touches the sockets.

Requests go to the broker over a DEALER socket; replies come straight from the worker to a PULL
socket the client binds (its address travels in the request). The thread heartbeats the broker,
sends every request again with the same id when the broker is lost or restarted or its connection
ends (a message cut off midway is lost with it), and hands what
arrives to the pending requests (pending.py, worker_replies.py). User threads talk to it through a
queue and a wake-up pipe.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence

import torch
import zmq

from spec_serve.client.errors import BrokerUnreachable, RemoteError
from spec_serve.client.pending import RETRY_BACKOFF_S, Pending, Requests
from spec_serve.client.received import Received
from spec_serve.client.stats import ClientStats
from spec_serve.client.vocab import VocabRegistrations
from spec_serve.client.worker_replies import WorkerReplies
from spec_serve.paths.frames.hostpool import RecyclingAllocator
from spec_serve.paths.registry import ClientPaths
from spec_serve.protocol import wire
from spec_serve.protocol.commands import (
    CLIENT_PORT_HINT,
    CLIENT_TAG,
    CONNECT_TIMEOUT,
    CONTROL_SLACK_BYTES,
    FRONTEND_PORT,
    ClientCommand,
    ErrorCode,
    ProtocolError,
    control,
    frame_limit,
    in_parts,
    new_request_id,
    parse_control,
    reply_frame_limit,
)
from spec_serve.protocol.messages import (
    Bound,
    BrokerError,
    BrokerHeartbeat,
    Disconnect,
    SetVocab,
    StatusPage,
    VocabOk,
    WireMessage,
)
from spec_serve.supervision.contract import Expected
from spec_serve.telemetry.logs import Throttle, event
from spec_serve.transport.bounded import BoundedReader, Overlong
from spec_serve.transport.connwatch import ConnectWatch, connect_watched
from spec_serve.transport.ingress import Ingress
from spec_serve.transport.sockets import (
    KeyPolicy,
    Security,
    bound_endpoint,
    check_connect_url,
    make_socket,
    route_address,
)

log = logging.getLogger("spec_serve.client")

# The typed header of each command the broker sends clients.
_BROKER_MESSAGES: dict[ClientCommand, type[WireMessage]] = {
    ClientCommand.ERROR: BrokerError, ClientCommand.HEARTBEAT: BrokerHeartbeat, ClientCommand.STATUS: StatusPage,
    ClientCommand.VOCAB_OK: VocabOk, ClientCommand.BOUND: Bound, ClientCommand.DISCONNECT: Disconnect,
}


def _ipc_endpoint() -> str:
    return f"ipc://{os.environ.get('TMPDIR', '/tmp')}/spec-serve-{uuid.uuid4().hex}.sock"


class ClientIO(threading.Thread):
    """Owns the sockets; every other thread goes through ``call``, ``submit`` and ``register_vocab``."""

    def __init__(self, broker_url: str, *, security: Security | None, advertise_host: str | None,
                 max_retries: int, heartbeat_interval: float, liveness: int, max_message_bytes: int,
                 device: torch.device,
                 connect_timeout: float = CONNECT_TIMEOUT):
        super().__init__(name="spec-serve-client-io", daemon=True)
        self.broker_url = check_connect_url(broker_url, CLIENT_PORT_HINT, FRONTEND_PORT)
        self.ctx: zmq.Context = zmq.Context.instance()
        self.connect_timeout = connect_timeout
        self._created_at = time.monotonic()
        self._heard = False  # any valid message from the broker yet (on this or an earlier socket)
        self._lost_since: float | None = None  # broker silent past its liveness window, since when
        # Set while requests cannot reach a broker: new ones fail at once with it instead of waiting.
        self._unreachable: BrokerUnreachable | None = None
        self._misdirected = False  # the broker said we reached its workers' port
        self._watch: ConnectWatch | None = None
        self._broker_instance: str | None = None
        self.security = security
        self.heartbeat_interval = heartbeat_interval
        self.liveness = liveness
        self.max_message_bytes = max_message_bytes
        self.identity = uuid.uuid4().bytes
        self.stats = ClientStats()
        # CPU results spanning frames are assembled into reused buffers (fresh ones fault on every page).
        self.recv_alloc = RecyclingAllocator()
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._closing = threading.Event()
        self.requests = Requests(self._send, self.stats, max_retries,
                                 leave_binding=lambda request_id, why: self.replies.leave_pinned(request_id, why))
        self.vocab = VocabRegistrations()
        self._ipc_files: list[str] = []
        # Opened by _open_sockets before the constructor returns (or it raises): set whenever the thread runs.
        self.data: zmq.Socket | None = None
        self.dealer: zmq.Socket | None = None
        self.data_ingress: Ingress | None = None
        # Each socket's messages are read frame by frame; one with more frames than its kind is refused.
        self._readers: dict[zmq.Socket, BoundedReader] = {}
        self._refusal_log = Throttle(60.0)
        self.paths: ClientPaths | None = None  # set by use_paths before any request
        # The service and header each heartbeat carries (the rank's demand: client/demand.py), set by its owner.
        self.heartbeat_header: Callable[[], tuple[str, WireMessage | None]] = lambda: ("", None)
        self.replies = WorkerReplies(self.requests, self.stats, max_message_bytes, self.call,
                                     self._send_new)
        self._wake_r, self._wake_w = os.pipe()
        try:
            os.set_blocking(self._wake_w, False)
            self._open_sockets(broker_url, security, advertise_host)
        except BaseException:
            self._release_resources()  # a constructor that raises leaks no descriptor
            raise

    def _open_sockets(self, broker_url: str, security: Security | None, advertise_host: str | None) -> None:
        # Where peers reach us: the data socket, and a bound worker's gloo connections (binding.py).
        local = broker_url.startswith("ipc://")
        self.local_host = "127.0.0.1" if local else advertise_host or route_address(broker_url)
        if local:
            data_bind = _ipc_endpoint()
        else:
            data_bind = f"tcp://{self.local_host}:*"
        # With CURVE, only the workers' keys may push replies here (none without worker_keys_dir).
        self.data_keys = KeyPolicy(security.worker_keys_dir) if security else None
        self.data = make_socket(self.ctx, zmq.PULL, security=security, admit=self.data_keys)
        # Workers may push at most the replies we wait for (and one late duplicate) before we see them whole.
        self.data_ingress = Ingress(self.data, "client.data", total=self._reply_room, bind=data_bind)
        self._readers[self.data] = BoundedReader(self.data, lambda head: reply_frame_limit(self.max_message_bytes),
                                                 ingress=self.data_ingress)
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
        self._unlink_ipc_files()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _unlink_ipc_files(self) -> None:
        for path in self._ipc_files:  # libzmq leaves a named ipc socket's file behind
            with contextlib.suppress(OSError):
                os.unlink(path)

    def _connect(self) -> zmq.Socket:
        # No send high-water mark: a large request goes as many parts (protocol.commands.in_parts), all
        # queued at once; they are views of payloads this client holds anyway (credits bound those).
        sock = make_socket(self.ctx, zmq.DEALER, identity=self.identity, security=self.security, hwm=0)
        sock.setsockopt(zmq.RCVHWM, 64)
        # Only the broker sends here, control messages only.
        self._readers = {s: r for s, r in self._readers.items() if s is self.data}
        self._readers[sock] = BoundedReader(sock, lambda head: frame_limit(head, 0))
        # Watched while it lives: before a broker answers, why none does; after, each connection that ends.
        self._watch = connect_watched(sock, self.broker_url)
        return sock

    def _reply_room(self) -> int:
        """Bytes the data socket may hold undelivered (read by the ingress watcher thread)."""
        table = self.requests.table
        return table.expected + table.largest + CONTROL_SLACK_BYTES * (1 + len(table))

    def use_paths(self, paths: ClientPaths) -> None:
        """The reply paths (spec_serve/paths/registry.py) this client's requests offer and its replies come by."""
        self.paths = self.replies.paths = paths

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

    def submit(self, command: ClientCommand, service: str, header: WireMessage, payload: Sequence,
               timeout: float, request_id: bytes | None = None, max_retries: int | None = None,
               expect: Expected | None = None) -> concurrent.futures.Future:
        """Send a request; a future of its ``Received``. ``expect``: the tensors its reply must hold (checked
        before anything is allocated)."""
        pending = Pending(request_id or new_request_id(), command.value, service, header, list(payload),
                          concurrent.futures.Future(), timeout, max_retries=max_retries, expect=expect,
                          expect_bytes=expect.nbytes if expect else 0)
        self.call(lambda: self._send_new(pending))
        return pending.future

    def register_vocab(self, service: str, payload: list, header: SetVocab,
                       timeout: float) -> concurrent.futures.Future:
        """Register a mapping as the current one (SET_VOCAB with ``header``); a future of its digest.

        The same message releases our earlier registrations that no pending request names, so the
        broker keeps only live mappings however often the mapping changes.
        """
        digest: concurrent.futures.Future = concurrent.futures.Future()

        def send() -> None:
            release = self.vocab.release_unnamed(p.vocab for p in self.requests.table.values())
            pending = Pending(new_request_id(), ClientCommand.SET_VOCAB.value, service,
                              dataclasses.replace(header, release=release), payload, concurrent.futures.Future(),
                              timeout)
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
        answer = reply.result().header
        if not isinstance(answer, VocabOk):
            digest.set_exception(RemoteError(f"SET_VOCAB answered with {type(answer).__name__}"))
            return
        name = answer.digest
        self.vocab.record(name, service, payload)
        digest.set_result(name)

    def close(self) -> None:
        if self._closing.is_set():
            return
        # The I/O thread must send DISCONNECT before it stops, or the broker
        # counts this client (and what it queued) until its liveness expires.
        sent = threading.Event()

        def disconnect() -> None:
            self._disconnect()
            sent.set()

        self.call(disconnect)
        if self.is_alive():
            sent.wait(timeout=2)
        self._closing.set()
        self.join(timeout=5)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # ------------------------------------------------------------ I/O loop

    def run(self) -> None:
        self._poller = zmq.Poller()
        for sock in (self.dealer, self.data, self._wake_r):
            self._poller.register(sock, zmq.POLLIN)
        self._next_beat = 0.0
        self._broker_expiry = time.monotonic() + self.heartbeat_interval * self.liveness
        try:
            while not self._closing.is_set():
                events = self._poll()
                now = time.monotonic()
                self._run_calls(events)
                self._read_sockets(events, now)
                self._keep_alive(now)
                self._check_reached(now)
                self._check_link()
                self.requests.check_timers(now)
        finally:
            self._shut_down()

    def _poll(self) -> dict:
        """Wait for a socket or a call."""
        return dict(self._poller.poll(int(min(self.heartbeat_interval, 0.1) * 1000)))

    def _run_calls(self, events: dict) -> None:
        """What user threads handed us (``call``)."""
        if self._wake_r in events:
            os.read(self._wake_r, 4096)
        while True:
            try:
                self._inbox.get_nowait()()
            except queue.Empty:
                return

    def _read_sockets(self, events: dict, now: float) -> None:
        assert self.dealer is not None and self.data is not None  # opened in __init__
        if self.dealer in events:
            self._broker_expiry = now + self.heartbeat_interval * self.liveness
            self._drain(self.dealer, self._on_control)
        # Read every turn until a read finds nothing: that read tells the data socket's ingress watcher no
        # whole reply waits, even on a turn the poll did not wake for it.
        self._drain(self.data, self.replies.on_data)

    def _keep_alive(self, now: float) -> None:
        """Heartbeat the broker; a fresh socket when it stayed silent past its liveness window."""
        if now >= self._next_beat and not self._misdirected:
            service, header = self.heartbeat_header()
            self._send(control(CLIENT_TAG, ClientCommand.HEARTBEAT.value, service, header=header))
            self._next_beat = now + self.heartbeat_interval
            if self.paths is not None:
                self.paths.tick()
        if now > self._broker_expiry:
            self._broker_expiry = now + self.heartbeat_interval * self.liveness
            if self._heard:  # never reached: libzmq keeps retrying the same socket
                self._reconnect(now)

    def _shut_down(self) -> None:
        self.requests.close()
        if self._watch is not None:
            self._watch.close()
        assert self.dealer is not None and self.data is not None and self.data_ingress is not None  # opened in __init__
        self.dealer.close(linger=500)  # let a final DISCONNECT leave
        self.data_ingress.close()
        self.data.close(0)
        self._unlink_ipc_files()
        if self.paths is not None:
            self.paths.stop()

    def _drain(self, sock: zmq.Socket, handler: Callable[[list], None]) -> None:
        for _ in range(64):
            frames = self._readers[sock].read()
            if frames is None:  # nothing more now, or a refused message still being thrown away
                return
            if isinstance(frames, Overlong):
                self._refuse(sock, frames)
                continue
            try:
                handler(frames)
            except (ProtocolError, wire.WireError) as e:
                event(log, logging.WARNING, "client.bad_message", error=e)
            except Exception as e:  # whatever a peer sends, the I/O thread must live on
                log.exception("client.handler_failed error=%s", e)

    def _refuse(self, sock: zmq.Socket, overlong: Overlong) -> None:
        """A message with more frames than its kind has (a reply, or a broker message): count it, and cut the
        connection it came from if that was one to the data socket (a stranger's; workers never send it)."""
        self.stats.refused_messages += 1
        why = f"a message of more than {overlong.limit} frames, more than its kind has"
        if sock is self.data and self.data_ingress is not None:
            self.data_ingress.cut(overlong.source_fd, why)
        side = "data" if sock is self.data else "broker"
        held = self._refusal_log.ready(side, time.monotonic())
        if held is not None:
            event(log, logging.WARNING, "client.refused_message", socket=side, reason=why, similar_since_last=held)

    def _send(self, frames: list) -> None:
        """Send a control message to the broker (a large payload in parts, protocol.commands.in_parts)."""
        assert self.dealer is not None  # opened in __init__
        try:
            for part in in_parts(frames):
                self.dealer.send_multipart(part, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            pass  # not connected or saturated: timeouts and heartbeats recover

    def _send_new(self, pending: Pending) -> None:
        if self._unreachable is not None:
            pending.future.set_exception(BrokerUnreachable(str(self._unreachable)))
            return
        self.requests.add(pending, time.monotonic())

    def _disconnect(self) -> None:
        self._send(control(CLIENT_TAG, ClientCommand.DISCONNECT.value))

    # ------------------------------------------------------ broker health

    def _reconnect(self, now: float) -> None:
        """Lazy Pirate: the broker went silent; a fresh socket, and every outstanding request again."""
        if self._lost_since is None:  # one line per outage, not one per liveness window
            self._lost_since = now
            event(log, logging.WARNING, "client.broker_lost", broker=self.broker_url,
                  silent_s=round(self.heartbeat_interval * self.liveness, 1))
        assert self.dealer is not None and self._watch is not None  # opened in __init__
        self._poller.unregister(self.dealer)
        self._watch.close()
        self.dealer.close(0)
        self.dealer = self._connect()
        self._poller.register(self.dealer, zmq.POLLIN)
        self.stats.broker_reconnects += 1
        self._resend_all()

    def _resend_all(self) -> None:
        """The broker was lost or restarted: our vocab mappings and every pending request again."""
        for frames in self.vocab.all_registrations():
            self._send(frames)
        self.requests.resend_all(time.monotonic())

    def _broker_answered(self) -> None:
        """A valid message from the broker: we are (again) connected."""
        if self._lost_since is not None:
            event(log, logging.WARNING, "client.broker_regained", broker=self.broker_url,
                  after_s=round(time.monotonic() - self._lost_since, 1))
            self._lost_since = None
        if self._unreachable is not None:
            event(log, logging.WARNING, "client.broker_reached", broker=self.broker_url)
            self._unreachable = None
        self._heard = True

    def _check_reached(self, now: float) -> None:
        """Fail fast, naming the address and the likely cause, when no broker ever answered."""
        if self._heard or self._unreachable is not None:
            return
        assert self._watch is not None  # _connect watches every socket
        self._watch.read()  # keep the monitor's queue short; cause() needs only what it saw
        if now - self._created_at > self.connect_timeout:
            self._fail_all(BrokerUnreachable(
                f"no spec-serve broker answered at {self.broker_url} within {self.connect_timeout:g}s: "
                f"{self._watch.cause()}. Clients connect to {CLIENT_PORT_HINT}"))

    def _check_link(self) -> None:
        """The connection to the broker ended (the broker cut it, a slow link dropped it): libzmq reconnects,
        but a message cut off midway is lost. Every pending request and our mappings go again at once, at no
        cost to retries (request ids make that idempotent at the broker), not after a request timeout."""
        if self._watch is None or not self._watch.read_disconnects() or not self._heard or self._misdirected:
            return
        event(log, logging.WARNING, "client.broker_link_lost", broker=self.broker_url,
              pending=len(self.requests.table))
        self.stats.link_resends += 1
        self._resend_all()

    def _fail_all(self, error: BrokerUnreachable) -> None:
        """Requests cannot reach a broker: fail those pending, and every new one at once, with ``error``."""
        if self._unreachable is None:
            event(log, logging.WARNING, "client.broker_unreachable", broker=self.broker_url, error=error)
        self._unreachable = error
        for pending in self.requests.table.values():
            self.requests.fail(pending, BrokerUnreachable(str(error)))

    # ------------------------------------------------------ broker messages

    def _on_control(self, frames: list) -> None:
        msg = parse_control(frames, CLIENT_TAG, ClientCommand)
        command = ClientCommand(msg.command)
        header = _BROKER_MESSAGES[command].from_json(msg.header) if command in _BROKER_MESSAGES else None
        if isinstance(header, BrokerError) and header.code == ErrorCode.WRONG_PORT.value:
            self._misdirected = True  # no use heartbeating a port that only says so again
            self._fail_all(BrokerUnreachable(f"{self.broker_url}: {header.error}"))
            return
        self._broker_answered()
        if isinstance(header, BrokerHeartbeat):
            self._on_heartbeat(header.broker)
            if header.stopping:
                self._broker_stopping()
            return
        if isinstance(header, Disconnect):
            self._forgotten()
            return
        if self.paths is not None and header is not None:
            self.paths.on_broker(header)  # e.g. BOUND lost: our bound worker died (a pending BIND resolves below)
        pending = self.requests.table.get(msg.request_id)
        if pending is None or header is None:
            return
        if isinstance(header, BrokerError):
            self._on_refusal(pending, header)
        else:
            self.requests.resolve(pending, Received(msg.request_id, header, broker_command=command))

    def _broker_stopping(self) -> None:
        """The broker was told to stop: an outage starts now (one line); a successor's first heartbeat (a new
        instance id) makes us send it every pending request again."""
        if self._lost_since is None:
            self._lost_since = time.monotonic()
            event(log, logging.WARNING, "client.broker_stopping", broker=self.broker_url,
                  pending=len(self.requests.table))

    def _forgotten(self) -> None:
        """The broker forgot us (our heartbeats came too late): our mappings and every pending request again,
        the mappings first, so that no request reaches it before the mapping it names."""
        event(log, logging.WARNING, "client.forgotten_by_broker", broker=self.broker_url,
              pending=len(self.requests.table))
        self._resend_all()

    def _on_heartbeat(self, instance: str | None) -> None:
        if self._broker_instance is not None and instance != self._broker_instance:
            event(log, logging.WARNING, "client.broker_restarted", broker=self.broker_url)
            self._broker_instance = instance
            self._resend_all()
        self._broker_instance = instance

    def _on_refusal(self, pending: Pending, refusal: BrokerError) -> None:
        """The broker's ERROR for a pending request: retry, or fail it with what the code means."""
        code, error = refusal.code, refusal.error
        now = time.monotonic()
        registration = self.vocab.registration(pending.vocab) if refusal.unknown_vocab else None
        if registration is not None:  # we hold the mapping it names (a restarted broker lacks it, or forgot us)
            self._send(registration)
            self.requests.behind_registration(pending, now, error)
        elif code in (ErrorCode.TIMEOUT.value, ErrorCode.UNAVAILABLE.value, ErrorCode.INTERNAL.value):
            self.requests.retry(pending, now, error, delay=RETRY_BACKOFF_S,
                                exhausted=TimeoutError if code == ErrorCode.TIMEOUT.value else RemoteError)
        elif code == ErrorCode.TARGET_CHANGED.value:
            self.replies.target_changed(pending, error, worker=None)
        elif code == ErrorCode.KILLED_WORKERS.value:
            self.requests.fail(pending, RemoteError(error))
        else:
            self.requests.fail(pending, ValueError(error))

    # ------------------------------------------------- for the reply paths

    def send_control(self, frames: list) -> None:
        self._send(frames)
