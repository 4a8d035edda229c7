"""The worker's session with the broker, on the I/O thread: its verbs (READY, DONE, LEAVE; the broker's
DISCONNECT and REFUSED) over one DEALER. When to heartbeat, when the broker counts as lost (a fresh socket,
Lazy-Pirate style) and the one line per outage are the broker link's (transport/broker_link.py), shared
with the client; here the link is up once the broker answered our READY."""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

import zmq

from spec_serve.protocol.commands import (
    CONNECT_TIMEOUT,
    CONTROL_SLACK_BYTES,
    PART_BYTES,
    PART_FRAMES,
    WORKER_PORT_HINT,
    WORKER_TAG,
    Message,
    ProtocolError,
    WorkerCommand,
    control,
    frame_limit,
    parse_control,
)
from spec_serve.protocol.messages import Disconnect, Done, Leave, Ready, Refused
from spec_serve.supervision.target_info import TargetInfo
from spec_serve.telemetry.logs import Throttle, event
from spec_serve.transport.bounded import BoundedReader, Overlong
from spec_serve.transport.broker_link import BrokerLink
from spec_serve.transport.connwatch import ConnectWatch, connect_watched
from spec_serve.transport.ingress import Ingress
from spec_serve.transport.sockets import Security, local_host_key, make_socket

log = logging.getLogger("spec_serve.worker")

Handler = Callable[[Message], None]


class WorkerRefused(RuntimeError):
    """The broker refused to register this worker: its target differs from the service's, or it reached
    the broker's client port instead of the worker port."""


class BrokerSession:
    """One DEALER to the broker at a time. ``handlers`` serve the commands that carry work (REQUEST,
    BIND, RELEASE, SET_VOCAB); the session itself answers DISCONNECT (register again) and REFUSED
    (``WorkerRefused``). ``before_ready`` runs before each READY; False: do not register."""

    def __init__(self, ctx: zmq.Context, identity: bytes, name: str, broker_url: str, service: str, *,
                 security: Security | None, info: TargetInfo, capacity: int, max_message_bytes: int,
                 heartbeat_interval: float, liveness: int, handlers: Mapping[WorkerCommand, Handler],
                 before_ready: Callable[[], bool]):
        self.ctx, self.identity, self.name = ctx, identity, name
        self.broker_url, self.service, self.security = broker_url, service, security
        self.info, self.capacity, self.max_message_bytes = info, capacity, max_message_bytes
        self.heartbeat_interval, self.liveness = heartbeat_interval, liveness
        self.handlers, self.before_ready = handlers, before_ready
        # Set by open(), which comes before every other use.
        self.sock: zmq.Socket
        self._ingress: Ingress
        self._reader: BoundedReader
        # A request's payload reaches the broker in parts and comes on in the parts' frames.
        self._payload_frames = PART_FRAMES * (max_message_bytes // PART_BYTES + 2)
        self.refused_messages = 0  # messages with more frames than their kind has: refused unread
        self._refusal_log = Throttle(60.0)
        self._poller: zmq.Poller
        # Up once the broker answered our latest READY.
        self.link = BrokerLink("worker", broker_url, log, heartbeat_interval=heartbeat_interval, liveness=liveness,
                               connect_timeout=CONNECT_TIMEOUT, now=time.monotonic(), reconnect_unheard=True,
                               regained_level=logging.INFO)

    def open(self, poller: zmq.Poller) -> None:
        """Connect, register, and have ``poller`` watch the broker socket (this one and each reconnect's)."""
        self._poller = poller
        self._connect()
        now = time.monotonic()
        self.link.next_beat = now + self.heartbeat_interval
        self.link.heard(now)

    def close(self, linger_ms: int) -> None:
        self._ingress.close()
        self.sock.close(linger_ms)

    def _connect(self) -> None:
        sock = make_socket(self.ctx, zmq.DEALER, identity=self.identity, security=self.security)
        # Only the broker sends here: at most a request per slot (and a vocab mapping) at a time.
        self._ingress = Ingress(sock, "worker.broker", connect=self.broker_url,
                                total=(self.capacity + 1) * (self.max_message_bytes + CONTROL_SLACK_BYTES))
        self.sock = sock
        self._reader = BoundedReader(sock, lambda head: frame_limit(head, self._payload_frames), ingress=self._ingress)
        self._poller.register(sock, zmq.POLLIN)
        self._send_ready()

    def receive(self, now: float) -> None:
        """Handle what the broker sent; any valid message proves it alive until ``liveness`` beats from now."""
        heard = False
        while True:
            frames = self._reader.read()
            if frames is None:  # nothing more now, or a refused message still being thrown away
                break
            if isinstance(frames, Overlong):
                self._refuse(frames)
                continue
            try:
                msg = parse_control(frames, WORKER_TAG, WorkerCommand)
            except ProtocolError as e:
                event(log, logging.WARNING, "worker.bad_message", error=e)
                continue
            heard = True
            if self._dispatch(msg):
                self._send_ready()
            elif not self.link.up:
                self._on_registered()
        if heard:
            self.link.heard(now)

    @property
    def registered(self) -> bool:
        """The broker answered our latest READY and has not gone silent or stopped since."""
        return self.link.up

    def _refuse(self, overlong: Overlong) -> None:
        """A message with more frames than its kind has: never one a broker sends. Cut that connection (the
        socket reconnects) and count it."""
        self.refused_messages += 1
        why = f"a message of more than {overlong.limit} frames, more than its kind has"
        self._ingress.cut(overlong.source_fd, why)
        held = self._refusal_log.ready("broker", time.monotonic())
        if held is not None:
            event(log, logging.WARNING, "worker.refused_message", broker=self.broker_url, reason=why,
                  similar_since_last=held)

    def _dispatch(self, msg: Message) -> bool:
        """Handle one broker message; True if we must register again."""
        command = WorkerCommand(msg.command)
        if command is WorkerCommand.DISCONNECT:
            if Disconnect.from_json(msg.header).stopping:  # our next READY reaches its successor
                self.link.stopping(time.monotonic(), action="registering with its successor")
            return True
        if command is WorkerCommand.REFUSED:
            raise WorkerRefused(Refused.from_json(msg.header).error)
        handler = self.handlers.get(command)
        if handler is not None:
            handler(msg)
        return False

    def keep_alive(self, now: float) -> bool:
        """Heartbeat when due (True if one went), and reconnect if the broker has been silent too long."""
        due = self.link.tick(now)
        if due.beat:
            self.sock.send_multipart(control(WORKER_TAG, WorkerCommand.HEARTBEAT.value))
        if due.unreachable:
            event(log, logging.WARNING, "worker.broker_unreachable", broker=self.broker_url,
                  waited_s=round(now - self.link.started), expected=WORKER_PORT_HINT, action="still trying")
        if due.reconnect:  # Lazy-Pirate style: the broker went silent; reconnect and register again
            self._poller.unregister(self.sock)
            self._ingress.close()
            self.sock.close(0)
            self._connect()
        return due.beat

    def send_done(self, request_id: bytes, header: Done) -> None:
        """Tell the broker a request's reply left (or could not): its slot is free."""
        self.sock.send_multipart(control(WORKER_TAG, WorkerCommand.DONE.value, self.service, request_id, header))

    def leave(self, reason: str | None, *, drain: bool = False) -> None:
        """Leave the pool: for good (what we still hold goes to other workers), or, with ``drain``, no more
        requests while we finish or hand back what we hold (a LEAVE without drain follows)."""
        self.sock.send_multipart(control(WORKER_TAG, WorkerCommand.LEAVE.value, self.service,
                                         header=Leave(reason, drain=drain)))

    def confirm_left(self, timeout: float) -> bool:
        """After the final LEAVE: True once the broker has handled it, False if it did not within ``timeout``
        s (or was lost already). The broker answers a heartbeat from a worker it does not know with
        DISCONNECT, and handles one connection's messages in order, so that answer comes after the LEAVE."""
        if not self.link.up:
            return False
        self.sock.send_multipart(control(WORKER_TAG, WorkerCommand.HEARTBEAT.value))
        deadline = time.monotonic() + timeout
        while self.sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            frames = self._reader.read()
            if frames is None or isinstance(frames, Overlong):
                continue
            try:
                msg = parse_control(frames, WORKER_TAG, WorkerCommand)
            except ProtocolError:
                continue
            if msg.command == WorkerCommand.DISCONNECT.value:
                return True
            if time.monotonic() >= deadline:
                break
        return False

    def _send_ready(self) -> None:
        if not self.before_ready():
            return
        header = Ready(target_info=self.info.to_dict(), capacity=self.capacity, pid=os.getpid(),
                       host=socket.gethostname(), host_key=local_host_key(), max_message_bytes=self.max_message_bytes)
        self.sock.send_multipart(control(WORKER_TAG, WorkerCommand.READY.value, self.service, header=header))
        self.link.up = False  # until the broker answers this READY
        event(log, logging.DEBUG, "worker.registering", worker=self.name, service=self.service,
              broker=self.broker_url)

    def _on_registered(self) -> None:
        """The broker answered our READY: we serve from now on."""
        self.link.connected(time.monotonic())
        event(log, logging.INFO, "worker.ready", worker=self.name, service=self.service, broker=self.broker_url,
              target=self.info.model_name, capacity=self.capacity)


# ------------------------------------------------------------- before the model loads

# How long the check before loading waits for a broker's answer; a reachable one answers in milliseconds.
BROKER_CHECK_S = 5.0
# How often a worker told to wait for its broker (--wait-for-broker) tries again.
BROKER_RETRY_S = 1.0


class BrokerCheckFailed(RuntimeError):
    """No spec-serve broker's worker port answered; ``transient`` when a broker starting later could fix it
    (nothing listens yet, the name does not resolve yet), not when something else answered there."""

    def __init__(self, message: str, transient: bool):
        super().__init__(message)
        self.transient = transient


def check_broker(ctx: zmq.Context, url: str, security: Security | None, timeout: float = BROKER_CHECK_S) -> None:
    """Make sure ``url`` is a spec-serve broker's worker port before the (slow) model load: resolve its host,
    then a handshake that needs no target. A worker the broker does not know gets DISCONNECT for a
    heartbeat (register, please); a worker on the clients' port gets REFUSED (wrong_port). Raises
    ``BrokerCheckFailed`` naming the cause."""
    host = urlsplit(url).hostname if url.startswith("tcp://") else None
    if host and host != "*":
        try:
            socket.getaddrinfo(host, None)
        except (OSError, UnicodeError) as e:
            raise BrokerCheckFailed(f"the host name {host!r} does not resolve ({e})", transient=True) from None
    sock = make_socket(ctx, zmq.DEALER, identity=os.urandom(16), security=security)
    watch = connect_watched(sock, url, "worker")
    try:
        _await_broker(sock, watch, timeout)
    finally:
        watch.close()
        sock.close(0)


def _await_broker(sock: zmq.Socket, watch: ConnectWatch, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    sent = False
    reader = BoundedReader(sock, lambda head: frame_limit(head, 0))  # a broker answers with control messages
    while (left := deadline - time.monotonic()) > 0:
        if not sent:  # the heartbeat waits in the socket's queue until the connection is up
            try:
                sock.send_multipart(control(WORKER_TAG, WorkerCommand.HEARTBEAT.value), zmq.NOBLOCK)
                sent = True
            except zmq.Again:
                pass
        frames = reader.read() if sock.poll(int(min(left, 0.1) * 1000)) else None
        if frames is None:
            continue
        if isinstance(frames, Overlong):
            raise BrokerCheckFailed(f"the peer there sent a message of more than {frames.limit} frames: not a "
                                    f"spec-serve broker's worker port", transient=False)
        try:
            msg = parse_control(frames, WORKER_TAG, WorkerCommand)
        except ProtocolError as e:
            raise BrokerCheckFailed(f"the peer there answered, but not in the spec-serve worker protocol: {e}",
                                    transient=False) from None
        if msg.command == WorkerCommand.REFUSED.value:
            raise BrokerCheckFailed(Refused.from_json(msg.header).error, transient=False)
        return  # DISCONNECT (or a heartbeat): a broker's worker port
    cause = watch.cause()
    transient = "nothing accepts connections" in cause or "does not resolve" in cause
    raise BrokerCheckFailed(f"no spec-serve broker answered within {timeout:g}s: {cause}", transient=transient)


def wait_for_broker(ctx: zmq.Context, url: str, security: Security | None, wait: float,
                    check_s: float = BROKER_CHECK_S) -> None:
    """``check_broker``, tried again for up to ``wait`` seconds while the failure is one a broker starting
    later would fix (an orchestrator may start workers before the broker). Logs once while it waits."""
    deadline = time.monotonic() + wait
    waiting = False
    while True:
        try:
            check_broker(ctx, url, security, check_s)
        except BrokerCheckFailed as e:
            if not e.transient or time.monotonic() + BROKER_RETRY_S >= deadline:
                raise
            if not waiting:
                waiting = True
                event(log, logging.INFO, "worker.waiting_for_broker", broker=url, wait_s=wait, cause=e)
            time.sleep(BROKER_RETRY_S)
            continue
        event(log, logging.INFO, "worker.broker_checked", broker=url)
        return
