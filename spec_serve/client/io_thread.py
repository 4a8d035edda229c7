"""The client's I/O thread: it alone touches the sockets (sockets.py).

Requests go to the broker over a DEALER socket; replies come straight from the worker to a PULL
socket the client binds (its address travels in the request). The broker link (transport/broker_link.py,
shared with the worker) says when to heartbeat and when the broker is lost (a fresh socket, and every
request again with the same id) or was never reached (fail fast); a connection that ends (a message cut
off midway is lost with it) sends every request again at once. What arrives goes to the pending
requests: the broker's messages through broker_replies.py, the workers' through worker_replies.py. User
threads talk to the thread through a queue and a wake-up pipe.
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

from spec_serve.client.broker_replies import BrokerReplies
from spec_serve.client.errors import BrokerUnreachable, RemoteError
from spec_serve.client.pending import Pending, Requests
from spec_serve.client.sockets import ClientSockets
from spec_serve.client.stats import ClientStats
from spec_serve.client.vocab import VocabRegistrations
from spec_serve.client.worker_replies import WorkerReplies
from spec_serve.paths.frames.hostpool import RecyclingAllocator
from spec_serve.paths.registry import ClientPaths
from spec_serve.protocol.commands import (
    CLIENT_PORT_HINT,
    CLIENT_TAG,
    CONNECT_TIMEOUT,
    CONTROL_SLACK_BYTES,
    FRONTEND_PORT,
    ClientCommand,
    control,
    new_request_id,
)
from spec_serve.protocol.messages import SetVocab, VocabOk, WireMessage
from spec_serve.supervision.contract import Expected
from spec_serve.telemetry.logs import event
from spec_serve.transport.broker_link import BrokerLink
from spec_serve.transport.sockets import Security, check_connect_url

log = logging.getLogger("spec_serve.client")


class ClientIO(threading.Thread):
    """Owns the sockets; every other thread goes through ``call``, ``submit`` and ``register_vocab``."""

    def __init__(self, broker_url: str, *, security: Security | None, advertise_host: str | None,
                 max_retries: int, heartbeat_interval: float, liveness: int, max_message_bytes: int,
                 device: torch.device, connect_timeout: float = CONNECT_TIMEOUT):
        super().__init__(name="spec-serve-client-io", daemon=True)
        self.broker_url = check_connect_url(broker_url, CLIENT_PORT_HINT, FRONTEND_PORT)
        self.link = BrokerLink("client", self.broker_url, log, heartbeat_interval=heartbeat_interval,
                               liveness=liveness, connect_timeout=connect_timeout, now=time.monotonic(),
                               reconnect_unheard=False, beat_at_once=True)
        # Set while requests cannot reach a broker: new ones fail at once with it instead of waiting.
        self._unreachable: BrokerUnreachable | None = None
        self._misdirected = False  # the broker said we reached its workers' port: no use heartbeating it
        self.security, self.max_message_bytes = security, max_message_bytes
        self.identity = uuid.uuid4().bytes
        self.stats = ClientStats()
        # CPU results spanning frames are assembled into reused buffers (fresh ones fault on every page).
        self.recv_alloc = RecyclingAllocator()
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._closing = threading.Event()
        self.requests = Requests(self._send, self.stats, max_retries,
                                 leave_binding=lambda request_id, why: self.replies.leave_pinned(request_id, why))
        self.vocab = VocabRegistrations()
        self.paths: ClientPaths | None = None  # set by use_paths before any request
        # The service and header each heartbeat carries (the rank's demand: client/demand.py), set by its owner.
        self.heartbeat_header: Callable[[], tuple[str, WireMessage | None]] = lambda: ("", None)
        self.replies = WorkerReplies(self.requests, self.stats, max_message_bytes, self.call, self._send_new)
        self.broker = BrokerReplies(self.link, self.requests, self.vocab, self.replies, answered=self._answered,
                                    misdirected=self._wrong_port, resend_all=self._resend_all, send=self._send)
        self._wake_r, self._wake_w = os.pipe()
        try:
            os.set_blocking(self._wake_w, False)
            self.sockets = ClientSockets(zmq.Context.instance(), self.identity, self.broker_url, security=security,
                                         advertise_host=advertise_host, max_message_bytes=max_message_bytes,
                                         stats=self.stats, reply_room=self._reply_room)
        except BaseException:
            self._close_pipe()  # a constructor that raises leaks no descriptor
            raise
        # What the reply paths and RemoteTargetModel read.
        self.local_host, self.data_endpoint = self.sockets.local_host, self.sockets.data_endpoint
        self.data_key, self.data_keys = self.sockets.data_key, self.sockets.data_keys

    def _reply_room(self) -> int:
        """Bytes the data socket may hold undelivered (read by the ingress watcher thread)."""
        table = self.requests.table
        return table.expected + table.largest + CONTROL_SLACK_BYTES * (1 + len(table))

    def use_paths(self, paths: ClientPaths) -> None:
        """The reply paths (spec_serve/paths/registry.py) this client's requests offer and its replies come by."""
        self.paths = self.replies.paths = self.broker.paths = paths

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
        """Register a mapping as the current one (SET_VOCAB with ``header``); a future of its digest. The same
        message releases our earlier registrations that no pending request names, so the broker keeps only
        live mappings however often the mapping changes."""
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
        self.vocab.record(answer.digest, service, payload)
        digest.set_result(answer.digest)

    def close(self) -> None:
        if self._closing.is_set():
            return
        # The I/O thread must send DISCONNECT before it stops, or the broker
        # counts this client (and what it queued) until its liveness expires.
        sent = threading.Event()

        def disconnect() -> None:
            self._send(control(CLIENT_TAG, ClientCommand.DISCONNECT.value))
            sent.set()

        self.call(disconnect)
        if self.is_alive():
            sent.wait(timeout=2)
        self._closing.set()
        self.join(timeout=5)
        self._close_pipe()

    def _close_pipe(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # ------------------------------------------------------------ I/O loop

    def run(self) -> None:
        self._poller = zmq.Poller()
        for sock in (self.sockets.dealer, self.sockets.data, self._wake_r):
            self._poller.register(sock, zmq.POLLIN)
        self.link.heard(time.monotonic())  # the broker's first window starts with the loop
        try:
            while not self._closing.is_set():
                events = dict(self._poller.poll(int(min(self.link.heartbeat_interval, 0.1) * 1000)))
                now = time.monotonic()
                self._run_calls(events)
                self._read_sockets(events, now)
                self._keep_alive(now)
                self._check_link()
                self.requests.check_timers(now)
        finally:
            self._shut_down()

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
        dealer, data = self.sockets.dealer, self.sockets.data
        assert dealer is not None and data is not None  # opened in __init__
        if dealer in events:
            self.link.heard(now)
            self.sockets.drain(dealer, self.broker.on_control)
        # Read every turn until a read finds nothing: that read tells the data socket's ingress watcher no
        # whole reply waits, even on a turn the poll did not wake for it.
        self.sockets.drain(data, self.replies.on_data)

    def _keep_alive(self, now: float) -> None:
        """What the broker link says is due: a heartbeat, a fresh socket, failing fast."""
        due = self.link.tick(now)
        if due.beat and not self._misdirected:
            self._send(self._heartbeat())
            if self.paths is not None:
                self.paths.tick()
        if due.reconnect:  # Lazy Pirate: a fresh socket, and every outstanding request again
            self.sockets.reconnect(self._poller)
            self.stats.broker_reconnects += 1
            self._resend_all()
        if due.unreachable and self._unreachable is None:
            self._fail_all(BrokerUnreachable(
                f"no spec-serve broker answered at {self.broker_url} within {self.link.connect_timeout:g}s: "
                f"{self.sockets.watch.cause()}. Clients connect to {CLIENT_PORT_HINT}"))

    def _check_link(self) -> None:
        """The connection to the broker ended (the broker cut it, a slow link dropped it): libzmq reconnects,
        but a message cut off midway is lost. Every pending request and our mappings go again at once, at no
        cost to retries (request ids make that idempotent at the broker), not after a request timeout."""
        if not self.sockets.dropped() or not self.link.ever_up or self._misdirected:
            return
        event(log, logging.WARNING, "client.broker_link_lost", broker=self.broker_url,
              pending=len(self.requests.table))
        self.stats.link_resends += 1
        self._resend_all()

    def _heartbeat(self) -> list:
        """The heartbeat the client sends the broker each interval, with what ``heartbeat_header`` reports."""
        service, header = self.heartbeat_header()
        return control(CLIENT_TAG, ClientCommand.HEARTBEAT.value, service, header=header)

    def _shut_down(self) -> None:
        self.requests.close()
        self.sockets.close()
        if self.paths is not None:
            self.paths.stop()

    def _send(self, frames: list) -> None:
        self.sockets.send(frames)

    def _send_new(self, pending: Pending) -> None:
        if self._unreachable is not None:
            pending.future.set_exception(BrokerUnreachable(str(self._unreachable)))
            return
        self.requests.add(pending, time.monotonic())

    # ------------------------------------------------------ broker health

    def _resend_all(self) -> None:
        """The broker was lost, restarted or forgot us, or our connection ended: our vocab mappings and every
        pending request again, the mappings first (no request reaches it before the mapping it names)."""
        for frames in self.vocab.all_registrations():
            self._send(frames)
        self.requests.resend_all(time.monotonic())

    def _answered(self) -> None:
        """A valid message from the broker: we are (again) connected."""
        self.link.connected(time.monotonic())
        self._unreachable = None

    def _wrong_port(self, error: BrokerUnreachable) -> None:
        self._misdirected = True
        self._fail_all(error)

    def _fail_all(self, error: BrokerUnreachable) -> None:
        """Requests cannot reach a broker: fail those pending, and every new one at once, with ``error``."""
        if self._unreachable is None:
            event(log, logging.WARNING, "client.broker_unreachable", broker=self.broker_url, error=error)
        self._unreachable = error
        for pending in self.requests.table.values():
            self.requests.fail(pending, BrokerUnreachable(str(error)))

    # ------------------------------------------------- for the reply paths

    def send_control(self, frames: list) -> None:
        self._send(frames)
