"""A worker: one target replica (one GPU) serving supervision for the broker.

Two threads. The I/O thread owns every socket: it registers with the broker,
heartbeats (so a long forward never looks like death), receives requests, and
sends each reply straight to the requesting client's data socket before
telling the broker DONE. The compute thread runs the engine, one batch at a
time, and hands encoded replies back through a queue plus an inproc wake-up.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import queue
import socket
import threading
import time
import uuid
from typing import Any

import torch
import zmq

from spec_serve.protocol import digest

from spec_serve.engines import packing

from spec_serve.transport import samehost

from spec_serve.protocol import wire
from spec_serve.supervision.contract import REQUEST_TENSORS, Kind
from spec_serve.engines import engine_dead
from spec_serve.transport.hostpool import HostBufferPool, Lease, to_host
from spec_serve.transport.ingress import Ingress
from spec_serve.telemetry.logs import event, one_line
from spec_serve.protocol.commands import (
    BACKEND_PORT,
    CONNECT_TIMEOUT,
    CONTROL_SLACK_BYTES,
    HEARTBEAT_INTERVAL,
    HEARTBEAT_LIVENESS,
    WORKER_PORT_HINT,
    WORKER_TAG,
    ErrorCode,
    Message,
    Op,
    ProtocolError,
    Status,
    WorkerCommand,
    control,
    data_message,
    parse_control,
)
from spec_serve.transport.sockets import (
    DEFAULT_MAX_MESSAGE_BYTES,
    Security,
    check_connect_url,
    make_socket,
    route_address,
    send_lent,
)
from spec_serve.worker.threads import ThreadShare

log = logging.getLogger("spec_serve.worker")

# Client data sockets kept open, and how long an unused one lives.
MAX_DATA_SOCKETS = 64
DATA_SOCKET_IDLE_S = 120.0
# Replies a client's data socket queues before further ones are undeliverable (ZeroMQ SNDHWM).
DATA_SOCKET_HWM = 4
# A reply waits this long for a new data socket's connection; after that, a socket that takes nothing
# makes the reply undeliverable at once (it is refused or not read).
CONNECT_GRACE_S = 2.0
# A worker holds at most MAX_MAPPINGS + capacity draft-vocab mappings. The broker says which to drop
# (SET_VOCAB "evict") and never leaves more than 16 on a worker plus those its requests in flight name;
# dropping the oldest beyond this bound only guards against a broker that misbehaves.
MAX_MAPPINGS = 16
# Tokens in the load-time probe's forward (probe_engine).
PROBE_TOKENS = 4
# How long a worker whose engine died lets its last error replies and LEAVE drain before closing.
LEAVE_LINGER_MS = 2000


def probe_engine(engine) -> None:
    """One tiny forward (``PROBE_TOKENS`` tokens, EAGLE-3 compact: every layer and the lm_head) before
    the worker registers, so an engine that cannot serve this target fails at load, not on a client's
    request. Raises whatever the engine raises."""
    vocab = engine.target_info().vocab_size
    ids = (torch.arange(PROBE_TOKENS, dtype=torch.int64) % vocab).unsqueeze(0)
    ones = torch.ones_like(ids)
    engine.generate_batch(ids, ones, ones, kind=Kind.EAGLE3_COMPACT.value)


class WorkerRefused(RuntimeError):
    """The broker refused to register this worker: its target differs from the service's, or it reached
    the broker's client port instead of the worker port."""


def _check_packing(engine) -> None:
    """``ValueError`` unless ``engine`` can run packed forwards (the hf engine, on a model that allows it)."""
    if not hasattr(engine, "generate_packed"):
        raise ValueError(f"packing needs the hf engine; engine {getattr(engine, 'engine', type(engine).__name__)!r} "
                         f"has no packed forward (leave --packing off)")
    reason = engine.packing_unsupported()
    if reason is not None:
        raise ValueError(f"packing is not possible for this model: {reason} (leave --packing off)")


class RequestError(Exception):
    """A request the engine refused; ``code`` tells the client whether to retry."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code


@dataclasses.dataclass
class ReplySocket:
    """A PUSH socket to one client's data endpoint, and the replies it has not yet sent."""

    sock: zmq.Socket
    created: float
    used: float
    unsent: collections.deque = dataclasses.field(default_factory=collections.deque)  # (tracker, handed at)
    closed: bool = False

    def oldest_unsent(self, now: float) -> float:
        """Seconds the oldest reply handed to ZeroMQ has waited to leave (0 when all have)."""
        while self.unsent and self.unsent[0][0].done:
            self.unsent.popleft()
        return now - self.unsent[0][1] if self.unsent else 0.0

    def close(self, linger_ms: int = 0) -> None:
        # LINGER 0: ZeroMQ drops what it still queues, so every tracker of this socket completes and the
        # slabs those replies borrow go back to the pool (Worker._flush releases them). A worker whose
        # engine died, exiting, lingers instead: its last (error) replies must still leave.
        self.closed = True
        self.sock.close(linger_ms)


def _done_status(result: "Result") -> str:
    """The DONE status of a reply handed to ZeroMQ; ``engine_dead`` tells the broker to send no more."""
    if result.status is Status.OK:
        return "ok"
    return "engine_dead" if result.header.get("code") == ErrorCode.ENGINE_DEAD.value else "error"


@dataclasses.dataclass
class Job:
    request_id: bytes
    header: dict[str, Any]
    payload: list
    received_at: float
    tensors: dict | None = None  # decoded request, cached when the batcher looked at it
    control: str | None = None  # "bind" / "release": NCCL pairing, run in order with jobs on the compute thread


@dataclasses.dataclass
class Result:
    job: Job
    status: Status
    header: dict[str, Any]
    frames: list
    tokens: int = 0
    lease: Lease | None = None  # pooled host buffer the frames borrow; released once sent
    ready: "torch.cuda.Event | None" = None  # the frames' device->host copy; sent only once it completed
    send: dict | None = None  # tensors for the pair group, sent by the compute thread once this header is posted
    export: samehost.Export | None = None  # a slot lent through the same-host plane; cancelled if undeliverable

    @property
    def nbytes(self) -> int:
        """The reply's payload: its frames, plus the bytes it lends through the same-host plane."""
        return sum(len(memoryview(f)) for f in self.frames) + (self.export.nbytes if self.export else 0)

    def drop(self) -> None:
        """The reply will not be sent: what it borrowed goes back now."""
        if self.lease is not None:
            self.lease.release()
        if self.export is not None:
            self.export.cancel()


class Worker:
    """Serve ``engine`` to the broker at ``broker_url`` under ``service``."""

    def __init__(
        self,
        engine,
        broker_url: str,
        *,
        service: str = "default",
        capacity: int = 2,
        security: Security | None = None,
        heartbeat_interval: float = HEARTBEAT_INTERVAL,
        liveness: int = HEARTBEAT_LIVENESS,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        reply_timeout: float = 60.0,  # a data socket whose oldest reply has not left by then is closed
        context: zmq.Context | None = None,
        max_batch_tokens: int = 0,
        advertise_host: str | None = None,
        packing: bool = False,
        host_pool: bool | None = None,
        host_pool_buffers: int | None = None,
        threads: ThreadShare | None = None,
        plane_slots: int | None = None,
        plane_lease: float = samehost.DEFAULT_LEASE_S,
    ):
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        if max_batch_tokens < 0:
            raise ValueError("max_batch_tokens must be >= 0 (0: each request packed alone)")
        if max_batch_tokens and not packing:
            raise ValueError("max_batch_tokens is the token budget of packed forwards: turn packing on "
                             "(--packing) or leave it at 0")
        if packing:
            _check_packing(engine)
        device = torch.device(getattr(engine, "device", "cpu"))
        self.engine = engine
        self.threads = threads  # math threads: this worker's share of the host's cores, kept between forwards
        self.broker_url = check_connect_url(broker_url, WORKER_PORT_HINT, BACKEND_PORT)
        self.service = service
        self.capacity = capacity
        self.security = security
        self.heartbeat_interval = heartbeat_interval
        self.liveness = liveness
        self.max_message_bytes = max_message_bytes
        self.reply_timeout = reply_timeout
        self.ctx = context or zmq.Context.instance()
        self.identity = uuid.uuid4().bytes
        self.name = self.identity.hex()[:12]
        self.info = engine.target_info()
        self.vocab_size = self.info.vocab_size
        self._jobs: "queue.Queue[Job | None]" = queue.Queue()
        self._results: "queue.Queue[Result]" = queue.Queue()
        self._mappings: "collections.OrderedDict[str, tuple[torch.Tensor, torch.Tensor]]" = collections.OrderedDict()
        self._mapping_lock = threading.Lock()
        self._current_mapping: str | None = None
        self._stop = threading.Event()
        self._notify_endpoint = f"inproc://spec-serve-worker-{self.name}"
        self.served = 0
        # Set (once) when the engine died: the worker answers what found it so, then leaves the pool.
        self.engine_error: str | None = None
        self.replies_plane = 0
        self.replies_frames = 0
        # Packing (docs/packing.md): each generate request runs without its padding, and queued ones of
        # the same kind and vocab share one packed forward of at most max_batch_tokens real tokens
        # (0: each request alone). Off: every request runs padded, bit-equal to the colocated forward.
        self.packing = bool(packing)
        self.max_batch_tokens = int(max_batch_tokens)
        self.batches = 0  # packed forwards run for several requests
        # Replies are copied into pooled (pinned) host slabs, each reused once ZeroMQ has let go of every
        # frame that borrows it. On by default for GPU outputs; host_pool=True also pools a CPU engine's
        # outputs (SPEC_SERVE_HOST_POOL=1), so the reuse rules run in CPU tests; False: fresh host tensors.
        if host_pool_buffers is not None and host_pool_buffers < 1:
            raise ValueError("host_pool_buffers must be >= 1")
        self.device = device
        pooled = device.type == "cuda" if host_pool is None else bool(host_pool)
        self.host_pool = HostBufferPool(max_buffers=host_pool_buffers or capacity + 2,
                                        copy_host_tensors=device.type != "cuda") if pooled else None
        # The device->host copy of a reply runs on its own stream, so the next forward starts at once
        # instead of waiting for it (the I/O thread sends the reply when the copy's event completes).
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # Same-host clients get GENERATE replies through slots of memory they map (samehost.py); None: frames only.
        # run() owns the plane: it creates the shared-memory segments and closes them on the way out, so a
        # Worker that is built but never run holds none.
        self.plane: samehost.WorkerPlane | None = None
        self._plane_shape = (plane_slots or capacity + 2, plane_lease)
        self._tracked: list = []  # (MessageTracker over every frame, Lease) of replies still borrowing a slab
        self._data_sockets: "collections.OrderedDict[str, ReplySocket]" = collections.OrderedDict()  # I/O thread
        # NCCL data plane (docs/nccl.md): at most one client bound at a time. The pair is used only
        # on the compute thread; the I/O thread only records released prefixes.
        self.advertise_host = advertise_host  # where the bound client reaches our rendezvous store
        self._pair = None
        self._pair_client: str | None = None
        self._pair_prefix: str | None = None
        self._released: set[str] = set()
        self.nccl_sent = 0
        # Broker link, for lifecycle log lines: registered, lost, regained, never reached.
        self._started = time.monotonic()
        self._registered = False  # the broker has answered our latest READY
        self._ever_registered = False
        self._lost_since: float | None = None
        self._unreachable_logged = False
        # Test-only fault injection: abort the pair instead of the next N sends (tests/test_nccl_binding.py).
        self._test_fail_sends = int(os.environ.get("SPEC_SERVE_TEST_FAIL_NCCL_SEND", "0") or 0)
        # Test-only fault injection: flip one bit of the next N generate replies after their digests were
        # taken, as a reused buffer or a bad link would (tests/test_integrity.py).
        self._test_corrupt = int(os.environ.get("SPEC_SERVE_TEST_CORRUPT_REPLIES", "0") or 0)

    # ------------------------------------------------------------------ I/O

    def run(self) -> None:
        """Serve until ``stop()``."""
        self.plane = samehost.WorkerPlane.start(self.device, *self._plane_shape)
        wake = self.ctx.socket(zmq.PAIR)
        wake.bind(self._notify_endpoint)
        compute = threading.Thread(target=self._compute_loop, name="spec-serve-compute", daemon=True)
        compute.start()
        broker = self._connect()
        data_sockets = self._data_sockets
        outbox: collections.deque = collections.deque()
        next_beat = time.monotonic() + self.heartbeat_interval
        broker_expiry = time.monotonic() + self.heartbeat_interval * self.liveness
        poller = zmq.Poller()
        poller.register(wake, zmq.POLLIN)
        poller.register(broker, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                timeout = 5 if outbox or self._tracked else self.heartbeat_interval * 250
                events = dict(poller.poll(timeout))
                now = time.monotonic()
                if broker in events and self._receive_broker(broker):
                    broker_expiry = now + self.heartbeat_interval * self.liveness
                if wake in events or self.engine_error is not None:  # a dead engine's last answers: never wait
                    while True:
                        try:
                            wake.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                    while True:
                        try:
                            result = self._results.get_nowait()
                        except queue.Empty:
                            break
                        endpoint = result.job.header["reply_to"]
                        try:
                            sock = self._data_socket(data_sockets, endpoint, result.job.header, now)
                        except Exception as e:  # a reply_to or data_key no socket takes: no one to answer
                            event(log, logging.WARNING, "worker.bad_reply_to", endpoint=str(endpoint)[:80], error=e)
                            result.drop()
                            broker.send_multipart(control(WORKER_TAG, WorkerCommand.DONE.value, self.service,
                                                          result.job.request_id, {"status": "undeliverable",
                                                                                  "error": f"bad endpoint: {e}"}))
                            continue
                        outbox.append((sock, result))
                self._flush(outbox, broker, now)
                if self.engine_error is not None and not compute.is_alive() and self._results.empty() \
                        and not outbox:
                    self._leave(broker)  # every answer is out: in-flight requests go to other workers
                    break
                if now >= next_beat:
                    broker.send_multipart(control(WORKER_TAG, WorkerCommand.HEARTBEAT.value))
                    next_beat = now + self.heartbeat_interval
                    self._close_idle(data_sockets, now)
                if now > broker_expiry:
                    # Lazy-Pirate style: the broker went silent; reconnect and register again.
                    self._broker_silent(now)
                    poller.unregister(broker)
                    self._broker_ingress.close()
                    broker.close(0)
                    broker = self._connect()
                    poller.register(broker, zmq.POLLIN)
                    broker_expiry = now + self.heartbeat_interval * self.liveness
        except WorkerRefused as e:
            event(log, logging.ERROR, "worker.refused", worker=self.name, service=self.service, error=e)
            raise
        finally:
            self._jobs.put(None)
            self._broker_ingress.close()
            linger = LEAVE_LINGER_MS if self.engine_error is not None else 0
            broker.close(linger)
            wake.close(0)
            for reply_socket in data_sockets.values():
                reply_socket.close(linger)
            if self.plane is not None:
                self.plane.close()
                self.plane = None
            event(log, logging.INFO, "worker.stop", served=self.served, replies_plane=self.replies_plane,
                  replies_frames=self.replies_frames)

    def stop(self) -> None:
        self._stop.set()

    def _connect(self) -> zmq.Socket:
        sock = make_socket(self.ctx, zmq.DEALER, identity=self.identity, security=self.security)
        # Only the broker sends here: at most a request per slot (and a vocab mapping) at a time.
        self._broker_ingress = Ingress(sock, "worker.broker", connect=self.broker_url,
                                       total=(self.capacity + 1) * (self.max_message_bytes + CONTROL_SLACK_BYTES))
        self._send_ready(sock)
        return sock

    def _receive_broker(self, broker: zmq.Socket) -> bool:
        """Handle what the broker sent; True if any of it was a valid message."""
        heard = False
        while True:
            try:
                frames = broker.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return heard
            self._broker_ingress.delivered(frames)
            try:
                msg = parse_control(frames, WORKER_TAG, WorkerCommand)
            except ProtocolError as e:
                event(log, logging.WARNING, "worker.bad_message", error=e)
                continue
            heard = True
            if self._process_broker(broker, msg):
                self._send_ready(broker)
            elif not self._registered:
                self._on_registered()

    def _on_registered(self) -> None:
        """The broker answered our READY: we serve from now on."""
        self._registered = self._ever_registered = True
        now = time.monotonic()
        if self._lost_since is not None:
            event(log, logging.INFO, "worker.broker_regained", broker=self.broker_url,
                  after_s=round(now - self._lost_since, 1))
            self._lost_since = None
        event(log, logging.INFO, "worker.ready", worker=self.name, service=self.service, broker=self.broker_url,
              target=self.info.model_name, capacity=self.capacity)

    def _broker_silent(self, now: float) -> None:
        """Log a broker outage once (not once per liveness window), and a broker that never answered."""
        if self._registered:  # it was there: an outage starts (while it lasts, _registered stays False)
            self._lost_since = now
            event(log, logging.WARNING, "worker.broker_lost", broker=self.broker_url,
                  silent_s=round(self.heartbeat_interval * self.liveness, 1))
        never_answered = not self._ever_registered and not self._unreachable_logged
        if never_answered and now - self._started > CONNECT_TIMEOUT:
            self._unreachable_logged = True
            event(log, logging.WARNING, "worker.broker_unreachable", broker=self.broker_url,
                  waited_s=round(now - self._started), expected=WORKER_PORT_HINT, action="still trying")

    def _release(self, prefix) -> None:
        """I/O thread: the binding ``prefix`` ended; queued sends to it are skipped, the pair closed in order."""
        if isinstance(prefix, str):
            self._released.add(prefix)
            self._jobs.put(Job(b"", {"prefix": prefix}, [], time.monotonic(), control="release"))

    def _leave(self, broker: zmq.Socket) -> None:
        broker.send_multipart(control(WORKER_TAG, WorkerCommand.LEAVE.value, self.service,
                                      header={"reason": self.engine_error}))
        event(log, logging.ERROR, "worker.left_pool", worker=self.name, reason=f"engine dead: {self.engine_error}")

    def _send_ready(self, sock: zmq.Socket) -> None:
        if self.engine_error is not None:
            return  # a dead engine never registers again
        if self._pair_prefix is not None:
            self._release(self._pair_prefix)  # registering anew: the broker forgot our binding
        with self._mapping_lock:
            self._mappings.clear()  # the broker's record of what we hold starts empty with this READY
        header = {"target_info": self.info.to_dict(), "capacity": self.capacity, "pid": os.getpid(),
                  "host": socket.gethostname(), "max_message_bytes": self.max_message_bytes}
        sock.send_multipart(control(WORKER_TAG, WorkerCommand.READY.value, self.service, header=header))
        self._registered = False
        event(log, logging.DEBUG, "worker.registering", worker=self.name, service=self.service, broker=self.broker_url)

    def _process_broker(self, broker: zmq.Socket, msg: Message) -> bool:
        """Handle one broker message; True if we must register again."""
        command = WorkerCommand(msg.command)
        if command is WorkerCommand.REQUEST:
            if not isinstance(msg.header.get("reply_to"), str) or not msg.request_id:
                raise ProtocolError("REQUEST without reply_to or request id")
            self._jobs.put(Job(msg.request_id, msg.header, msg.payload, time.monotonic()))
            with contextlib.suppress(Exception):  # connect now, while the forward runs (errors: when replying)
                self._data_socket(self._data_sockets, msg.header["reply_to"], msg.header, time.monotonic())
        elif command is WorkerCommand.BIND:
            if not isinstance(msg.header.get("reply_to"), str) or not isinstance(msg.header.get("prefix"), str) \
                    or not msg.request_id:
                raise ProtocolError("BIND without reply_to, prefix or request id")
            self._jobs.put(Job(msg.request_id, msg.header, [], time.monotonic(), control="bind"))
        elif command is WorkerCommand.RELEASE:
            self._release(msg.header.get("prefix"))
        elif command is WorkerCommand.SET_VOCAB:
            self._store_mapping(msg)
        elif command is WorkerCommand.DISCONNECT:
            return True
        elif command is WorkerCommand.REFUSED:
            raise WorkerRefused(str(msg.header.get("error") or "no reason given"))
        return False

    def _store_mapping(self, msg: Message) -> None:
        digest = msg.header.get("digest")
        try:
            tensors = wire.decode(msg.payload, max_bytes=self.max_message_bytes)
            mapping = (tensors["selected_token_ids"].clone(), tensors["selected_token_mask"].clone())
        except (wire.WireError, KeyError) as e:
            event(log, logging.WARNING, "worker.bad_mapping", digest=digest, error=e)
            return
        evict = msg.header.get("evict", [])
        with self._mapping_lock:
            for old in evict if isinstance(evict, list) else ():
                if isinstance(old, str):
                    self._mappings.pop(old, None)
            self._mappings[str(digest)] = mapping
            self._mappings.move_to_end(str(digest))
            while len(self._mappings) > MAX_MAPPINGS + self.capacity:
                self._mappings.popitem(last=False)

    def _data_socket(self, sockets: collections.OrderedDict, endpoint: str, header: dict, now: float) -> ReplySocket:
        entry = sockets.get(endpoint)
        if entry is None:
            server_key = header.get("data_key")
            if server_key is not None and not isinstance(server_key, str):
                raise ProtocolError("data_key must be a Z85 string")
            # immediate: replies queue only on a connection that completed its handshake, so an endpoint
            # that refuses (or never completes one) takes nothing and its replies fail at once.
            sock = make_socket(self.ctx, zmq.PUSH, connect=endpoint, security=self.security, hwm=DATA_SOCKET_HWM,
                               curve_server_key=server_key.encode() if server_key else None, immediate=True)
            entry = sockets[endpoint] = ReplySocket(sock, created=now, used=now)
            while len(sockets) > MAX_DATA_SOCKETS:
                sockets.popitem(last=False)[1].close()
        entry.used = now
        sockets.move_to_end(endpoint)
        return entry

    def _close_idle(self, sockets: collections.OrderedDict, now: float) -> None:
        """Close data sockets unused for DATA_SOCKET_IDLE_S, and any whose oldest reply has not left
        within ``reply_timeout`` (a client that stopped reading): that frees what it borrows."""
        for endpoint, reply_socket in list(sockets.items()):
            stuck = reply_socket.oldest_unsent(now) > self.reply_timeout
            if stuck or now - reply_socket.used > DATA_SOCKET_IDLE_S:
                sockets.pop(endpoint).close()
            if stuck:
                event(log, logging.WARNING, "worker.reply_stuck", endpoint=endpoint[:80],
                      unsent=len(reply_socket.unsent))

    def _flush(self, outbox: collections.deque, broker: zmq.Socket, now: float) -> None:
        """Hand ready replies to ZeroMQ without blocking and tell the broker DONE at once: the slot is
        free whether the reply went out or was undeliverable (dropped; the broker tells the client)."""
        if self._tracked:
            still = []
            for tracker, lease in self._tracked:
                if tracker.done:
                    lease.release()
                else:
                    still.append((tracker, lease))
            self._tracked = still
        for _ in range(len(outbox)):
            reply_socket, result = outbox.popleft()
            if result.ready is not None and not result.ready.query():
                outbox.append((reply_socket, result))  # its device->host copy is still running
                continue
            sent = self._hand_off(reply_socket, result, now)
            if sent is None:
                outbox.append((reply_socket, result))  # its socket is still connecting
                continue
            header = {"status": _done_status(result) if sent else "undeliverable",
                      "tokens": result.tokens, "bytes": result.nbytes,
                      "via": result.export.descriptor["kind"] if result.export is not None else "frames"}
            if not sent:
                header["error"] = "its data socket takes nothing (the endpoint refuses, or nothing reads it)"
            broker.send_multipart(control(WORKER_TAG, WorkerCommand.DONE.value, self.service, result.job.request_id,
                                          header))
            self.served += 1

    def _hand_off(self, reply_socket: ReplySocket, result: Result, now: float) -> bool | None:
        """Give a reply to ZeroMQ: True if taken, False if undeliverable (dropped), None to retry shortly."""
        if not reply_socket.closed:
            frames = data_message(result.status, result.job.request_id, result.header, result.frames)
            try:
                # One tracker over every frame (not the last frame's alone, which pyzmq may have copied and
                # finished at once): a slab goes back, and a reply counts as sent, only once all have left.
                tracker = send_lent(reply_socket.sock, frames, zmq.NOBLOCK)
            except zmq.Again:
                if now - reply_socket.created < CONNECT_GRACE_S:
                    return None
            else:
                reply_socket.unsent.append((tracker, now))
                if result.lease is not None:
                    self._tracked.append((tracker, result.lease))
                if result.export is not None:
                    self.replies_plane += 1
                else:
                    self.replies_frames += 1
                return True
        result.drop()
        event(log, logging.INFO, "worker.reply_undeliverable", request=result.job.request_id.hex()[:12])
        return False

    # -------------------------------------------------------------- compute

    def _compute_loop(self) -> None:
        wake = self.ctx.socket(zmq.PAIR)
        wake.connect(self._notify_endpoint)
        try:
            backlog: collections.deque = collections.deque()
            while self.engine_error is None:
                if not backlog:
                    job = self._jobs.get()
                    if job is None:
                        return
                    backlog.append(job)
                if self.threads is not None:
                    self.threads.rebalance()
                if backlog[0].control is not None:  # bind/release, in order with the jobs before it
                    self._pair_control(backlog.popleft(), wake)
                    continue
                if not self.packing or self.max_batch_tokens <= 0:
                    result = self.serve(backlog.popleft())
                    self._results.put(result)
                    wake.send(b"")
                    self._pair_send([result])
                    continue
                while True:  # everything queued now may share the packed forward
                    try:
                        job = self._jobs.get_nowait()
                    except queue.Empty:
                        break
                    if job is None:
                        return
                    backlog.append(job)
                results = self.serve_group(self._take_group(backlog))
                for result in results:
                    self._results.put(result)
                wake.send(b"")
                self._pair_send(results)
        finally:
            wake.close(0)

    def serve(self, job: Job) -> Result:
        """Run one job on the engine; every failure becomes an error reply."""
        start = time.perf_counter()
        try:
            nccl = bool(job.header.get("nccl")) and job.header.get("op", Op.GENERATE.value) == Op.GENERATE.value
            if nccl:
                self._check_pair(job)
            tensors, tokens = self._execute(job)
            integrity = self._integrity([job], [tensors])[0]
            if nccl:  # metadata over ZeroMQ, then the tensors (still on our device) over the pair group
                from spec_serve.transport.binding import encode_specs

                header = {"worker": self.name, "compute_s": round(time.perf_counter() - start, 6), "nccl": True,
                          "pair": self._pair_prefix, "specs": encode_specs(tensors), **integrity}
                return Result(job, Status.OK, header, [], tokens, send=self._test_corrupt_tensors(job, tensors))
            export = self._lend(job, tensors)
            if export is not None:  # same-host client: the bytes wait in a slot it maps
                self._test_corrupt_lent(export)
                header = {"worker": self.name, "compute_s": round(time.perf_counter() - start, 6),
                          "plane": export.descriptor, **integrity}
                return self._within_client_limit(Result(job, Status.OK, header, export.frames, tokens,
                                                        ready=export.ready, export=export))
            host, lease, ready = to_host(tensors, self.host_pool, self._copy_stream)
            try:
                frames = wire.encode(host)
            except BaseException:
                if lease is not None:
                    lease.release()
                raise
            self._test_corrupt_frames(job, frames, ready)
            header = {"worker": self.name, "compute_s": round(time.perf_counter() - start, 6), **integrity}
            return self._within_client_limit(Result(job, Status.OK, header, frames, tokens, lease, ready))
        except RequestError as e:
            code, message = e.code, str(e)
        except (ValueError, wire.WireError) as e:
            code, message = ErrorCode.BAD_REQUEST, str(e)
        except Exception as e:
            if engine_dead(e):
                return self._dead_result(job, e)
            log.exception("worker.engine_failed worker=%s", self.name)  # the engine failed: report, keep serving
            code, message = ErrorCode.INTERNAL, f"{type(e).__name__}: {e}"
        event(log, logging.INFO, "worker.request_failed", code=code.value, error=message)
        return Result(job, Status.ERROR, {"worker": self.name, "code": code.value, "error": message}, [])

    def _integrity(self, jobs: list[Job], outputs: list[dict[str, torch.Tensor]]) -> list[dict[str, Any]]:
        """Per job, the reply header fields its client checks: the fingerprint of the target that computed
        it and, when the request asked (``verify``), a digest of each output tensor, taken here on our
        device before any copy (spec_serve/protocol/digest.py); one host transfer for all of them."""
        fingerprint = self.engine.target_info().fingerprint
        wanted = [i for i, job in enumerate(jobs) if job.header.get("verify")]
        fields: list[dict[str, Any]] = [{"fingerprint": fingerprint} for _ in jobs]
        for i, sums in zip(wanted, digest.digests([outputs[i] for i in wanted])):
            fields[i]["digests"] = sums
        return fields

    def _test_corrupt_frames(self, job: Job, frames: list, ready) -> None:
        """Test-only (SPEC_SERVE_TEST_CORRUPT_REPLIES): flip the low bit of a generate reply's first data byte."""
        if self._test_corrupt <= 0 or job.header.get("op", Op.GENERATE.value) != Op.GENERATE.value:
            return
        self._test_corrupt -= 1
        if ready is not None:
            ready.synchronize()  # the device->host copy must not overwrite the flip
        data = next(memoryview(f) for f in frames[1:] if len(memoryview(f)))
        data[0] ^= 1

    def _test_corrupt_lent(self, export: samehost.Export) -> None:
        """Test-only (SPEC_SERVE_TEST_CORRUPT_REPLIES): flip the low bit of a lent reply's first byte in its slot."""
        if self._test_corrupt <= 0:
            return
        self._test_corrupt -= 1
        if export.ready is not None:
            export.ready.synchronize()  # the copy into the slot must not overwrite the flip
        export.data[0] ^= 1

    def _test_corrupt_tensors(self, job: Job, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Test-only (SPEC_SERVE_TEST_CORRUPT_REPLIES): the NCCL reply with one bit of its largest tensor flipped."""
        if self._test_corrupt <= 0:
            return tensors
        self._test_corrupt -= 1
        name = max(tensors, key=lambda n: tensors[n].numel())
        bad = tensors[name].contiguous().clone()
        bad.view(-1).view(torch.uint8)[0] ^= 1
        return {**tensors, name: bad}

    def _within_client_limit(self, result: Result) -> Result:
        """``result``, or a bad_request error if its payload exceeds the ``max_reply_bytes`` the client
        named: refused here, once, rather than sent for the client to drop (and ask for again)."""
        limit = result.job.header.get("max_reply_bytes")
        size = result.nbytes
        if not isinstance(limit, int) or size <= limit:
            return result
        result.drop()
        message = (f"reply of {size} bytes exceeds the client's max_message_bytes of {limit}: raise the "
                   f"client's max_message_bytes or send fewer rows per request (num_shards)")
        event(log, logging.INFO, "worker.request_failed", code=ErrorCode.BAD_REQUEST.value, error=message)
        return Result(result.job, Status.ERROR, {"worker": self.name, "code": ErrorCode.BAD_REQUEST.value,
                                                 "error": message}, [])

    def _dead_result(self, job: Job, exc: BaseException) -> Result:
        """The engine died running ``job``: answer ``engine_dead`` and stop serving (run() then leaves)."""
        if self.engine_error is None:
            self.engine_error = one_line(exc)
            log.error("worker.engine_dead worker=%s error=%s", self.name, self.engine_error,
                      exc_info=log.isEnabledFor(logging.DEBUG))
        return Result(job, Status.ERROR, {"worker": self.name, "code": ErrorCode.ENGINE_DEAD.value,
                                          "error": self.engine_error}, [])

    def _execute(self, job: Job) -> tuple[dict[str, torch.Tensor], int]:
        op = job.header.get("op", Op.GENERATE.value)
        if op == Op.GENERATE.value:
            return self._generate(job)
        if op == Op.EMBEDDINGS.value:
            which = job.header.get("which")
            if which == "input":
                weight = self.engine.get_input_embeddings().weight
            elif which == "output":
                weight = self.engine.get_output_embeddings().weight
            else:
                raise RequestError(ErrorCode.BAD_REQUEST, f"embeddings 'which' must be input or output, got {which!r}")
            return {"weight": weight.detach().to("cpu").contiguous()}, 0
        if op == Op.LM_HEAD_SLICE.value:
            ids, _ = self._mapping(job.header.get("vocab"))
            weight = self.engine.get_output_embeddings().weight.detach()
            return {"weight": weight.index_select(0, ids.to(weight.device)).to("cpu")}, 0
        raise RequestError(ErrorCode.BAD_REQUEST, f"unknown op {op!r}")

    def _generate(self, job: Job) -> tuple[dict[str, torch.Tensor], int]:
        kind = Kind.parse(job.header.get("kind", Kind.EAGLE3.value))
        tensors = self._request_tensors(job)
        self._select_mapping(kind, job)
        request = tuple(tensors[n] for n in REQUEST_TENSORS)
        if self.packing and packing.row_lengths(tensors["attention_mask"], tensors["loss_mask"]) is not None:
            out = self.engine.generate_packed([request], kind=kind.value)[0]
        else:  # not packing, or a request packing cannot take (left padding, loss on padding): padded
            out = self.engine.generate_batch(*request, kind=kind.value)
        tokens = int(tensors["attention_mask"].sum())
        return out, tokens

    def _request_tensors(self, job: Job) -> dict[str, torch.Tensor]:
        if job.tensors is not None:
            return job.tensors
        tensors = wire.decode(job.payload, max_bytes=self.max_message_bytes)
        missing = [n for n in REQUEST_TENSORS if n not in tensors]
        if missing or len(tensors) != len(REQUEST_TENSORS):
            raise RequestError(ErrorCode.BAD_REQUEST,
                               f"request must hold exactly {list(REQUEST_TENSORS)}, got {sorted(tensors)}")
        job.tensors = tensors
        return tensors

    def _select_mapping(self, kind: Kind, job: Job) -> None:
        if kind in (Kind.EAGLE3, Kind.EAGLE3_COMPACT):
            digest = job.header.get("vocab")
            if digest != self._current_mapping or not isinstance(digest, str):
                # _mapping refuses a missing digest as BAD_REQUEST (never retried)
                self.engine.set_vocab_mapping(*self._mapping(digest))
                self._current_mapping = digest

    # ------------------------------------------------------------- packing

    def _pack_key(self, job: Job):
        """What must match for two jobs to share a packed forward, and the job's real tokens; None if the
        job runs alone (not a plain generate request, bound to a pair group, or not packable)."""
        if job.header.get("op", Op.GENERATE.value) != Op.GENERATE.value or job.header.get("nccl") \
                or job.control is not None:
            return None
        try:
            tensors = self._request_tensors(job)
            ids = tensors["input_ids"]
            if ids.dim() != 2 or any(t.shape != ids.shape for t in tensors.values()):
                return None
            lengths = packing.row_lengths(tensors["attention_mask"], tensors["loss_mask"])
        except (RequestError, wire.WireError, ValueError):
            return None  # served alone, which reports the error
        if lengths is None:
            return None
        return (job.header.get("kind", Kind.EAGLE3.value), job.header.get("vocab")), sum(lengths)

    def _take_group(self, backlog: collections.deque) -> list[Job]:
        """Pop the oldest job and every later one that can share its packed forward within the token
        budget (order kept). The scan stops at a bind/release, which must run in order."""
        first = backlog.popleft()
        head = self._pack_key(first)
        if head is None or head[1] >= self.max_batch_tokens:
            return [first]
        key, tokens = head
        group, rest = [first], collections.deque()
        while backlog and backlog[0].control is None:
            job = backlog.popleft()
            other = self._pack_key(job)
            if other is not None and other[0] == key and tokens + other[1] <= self.max_batch_tokens:
                group.append(job)
                tokens += other[1]
            else:
                rest.append(job)
        backlog.extendleft(reversed(rest))
        return group

    def serve_group(self, jobs: list[Job]) -> list[Result]:
        """Serve jobs with one packed forward and split the result per job; one job: ``serve``."""
        if len(jobs) == 1:
            return [self.serve(jobs[0])]
        start = time.perf_counter()
        try:
            kind = Kind.parse(jobs[0].header.get("kind", Kind.EAGLE3.value))
            parts = [self._request_tensors(job) for job in jobs]
            self._select_mapping(kind, jobs[0])
            outs = self.engine.generate_packed([tuple(p[n] for n in REQUEST_TENSORS) for p in parts], kind=kind.value)
            elapsed = round(time.perf_counter() - start, 6)
            results = self._split_replies(jobs, parts, outs, {"worker": self.name, "compute_s": elapsed,
                                                              "batched": len(jobs)})
            self.batches += 1
            return [self._within_client_limit(result) for result in results]
        except Exception as e:  # e.g. one bad row: serve each alone, so each gets its own answer
            if engine_dead(e):  # any of these rows may be what killed it
                return [self._dead_result(job, e) for job in jobs]
            event(log, logging.INFO, "worker.batch_failed", jobs=len(jobs), error=e)
            return [self.serve(job) for job in jobs]

    def _split_replies(self, jobs: list[Job], parts: list[dict], outs: list[dict], header: dict) -> list[Result]:
        """One reply per job of a packed forward: each same-host job's outputs lent in a slot of its own, the
        others' encoded from one host slab for all of them (released once per reply)."""
        integrity = self._integrity(jobs, outs)
        exports: list = []
        lease = None
        try:
            for job, out in zip(jobs, outs):
                exports.append(self._lend(job, out))
            framed = [i for i, export in enumerate(exports) if export is None]
            host, lease, ready = to_host({(i, k): v for i in framed for k, v in outs[i].items()}, self.host_pool,
                                         self._copy_stream) if framed else ({}, None, None)
            results = []
            for i, (job, part, export, checks) in enumerate(zip(jobs, parts, exports, integrity)):
                tokens = int(part["attention_mask"].sum())
                if export is not None:
                    results.append(Result(job, Status.OK, dict(header, plane=export.descriptor, **checks),
                                          export.frames, tokens, ready=export.ready, export=export))
                else:
                    frames = wire.encode({k: host[(i, k)] for k in outs[i]})
                    results.append(Result(job, Status.OK, dict(header, **checks), frames, tokens, lease, ready))
            if lease is not None:
                lease.retain(len(framed) - 1)  # one release per reply sent
            return results
        except BaseException:
            if lease is not None:
                lease.release()
            for export in exports:
                if export is not None:
                    export.cancel()
            raise

    def _lend(self, job: Job, tensors: dict[str, torch.Tensor]) -> samehost.Export | None:
        """A GENERATE reply lent to a same-host client through the plane; None: send it as frames."""
        if self.plane is None or job.header.get("op", Op.GENERATE.value) != Op.GENERATE.value:
            return None
        return self.plane.export(job.header, tensors, self._copy_stream)

    # ------------------------------------------------- NCCL data plane (pair)

    def _pair_control(self, job: Job, wake: zmq.Socket) -> None:
        """Compute thread: bind (host the store, tell the client, form the group) or release."""
        if job.control == "release":
            if job.header.get("prefix") == self._pair_prefix:
                self._close_pair("released")
            return
        from spec_serve.transport.pairgroup import PairGroup

        header = job.header
        prefix, timeout = header["prefix"], float(header.get("timeout", 30.0))
        self._close_pair("rebound")
        if prefix in self._released:  # released before we got to it
            self._released.discard(prefix)
            return
        if self.security is not None:
            self._post(Result(job, Status.ERROR, {"worker": self.name, "code": ErrorCode.UNAVAILABLE.value, "error": (
                f"worker {self.name} runs CURVE: an NCCL binding's rendezvous (TCPStore, gloo/NCCL connections) "
                f"is not authenticated, so it is refused; replies go as CURVE frames")}, []), wake)
            return
        if header.get("device_type", self.device.type) != self.device.type:
            self._post(Result(job, Status.ERROR, {"worker": self.name, "code": ErrorCode.UNAVAILABLE.value, "error": (
                f"worker device is {self.device.type}, client device is {header.get('device_type')}: the pair "
                f"group needs both on CUDA (NCCL) or both on CPU (gloo)")}, []), wake)
            return
        try:
            if self.advertise_host is None:
                self.advertise_host = route_address(self.broker_url)
            store, port = PairGroup.host_store(self.advertise_host, 0, timeout)
        except Exception as e:
            self._post(Result(job, Status.ERROR, {"worker": self.name, "code": ErrorCode.UNAVAILABLE.value,
                                                  "error": f"could not host the rendezvous store: {e}"}, []), wake)
            return
        info = {"store_host": self.advertise_host, "store_port": port, "prefix": prefix, "worker": self.name,
                "timeout": timeout}
        self._post(Result(job, Status.OK, {"worker": self.name, "bind": info}, []), wake)
        try:
            pair = PairGroup.create(self.advertise_host, port, 0, device=self.device, prefix=prefix, timeout=timeout,
                                    store=store, listen_host=self.advertise_host)
        except Exception as e:  # the client falls back to frames on its side
            event(log, logging.WARNING, "worker.nccl_bind_failed", client=str(header.get("client"))[:12], error=e)
            return
        self._pair, self._pair_client, self._pair_prefix = pair, header.get("client"), prefix
        event(log, logging.INFO, "worker.nccl_bound", client=str(header.get("client"))[:12],
              backend="nccl" if self.device.type == "cuda" else "gloo", device=self.device)

    def _post(self, result: Result, wake: zmq.Socket) -> None:
        self._results.put(result)
        wake.send(b"")

    def _check_pair(self, job: Job) -> None:
        if self._pair is None or self._pair.closed or self._pair_prefix in self._released:
            raise RequestError(ErrorCode.UNAVAILABLE, f"worker {self.name} has no live pair group")
        if job.header.get("client") != self._pair_client:
            raise RequestError(ErrorCode.UNAVAILABLE, f"worker {self.name} is not bound to this client")

    def _pair_send(self, results: list[Result]) -> None:
        """Compute thread, after the results' headers were posted: send the bound replies' tensors."""
        for result in results:
            tensors, result.send = result.send, None
            if tensors is None:
                continue
            pair = self._pair
            try:
                if pair is None or self._pair_prefix in self._released:
                    raise RuntimeError("binding released before the send")
                if self._test_fail_sends > 0:  # test-only fault injection
                    self._test_fail_sends -= 1
                    pair.abort()
                    raise RuntimeError("SPEC_SERVE_TEST_FAIL_NCCL_SEND: send aborted (test hook)")
                pair.send_tensors(tensors)
                self.nccl_sent += 1
            except Exception as e:  # PairGroupError aborted the group: the client re-sends as frames
                event(log, logging.WARNING, "worker.nccl_send_failed", request=result.job.request_id.hex()[:12],
                      error=e)
                self._close_pair("send failed")

    def _close_pair(self, reason: str) -> None:
        pair, self._pair = self._pair, None
        if pair is not None:
            pair.close()
            event(log, logging.INFO, "worker.nccl_unbound", client=str(self._pair_client)[:12], reason=reason,
                  sent=self.nccl_sent)
        if self._pair_prefix is not None:
            self._released.discard(self._pair_prefix)
        self._pair_client = self._pair_prefix = None

    def _mapping(self, digest) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(digest, str):
            raise RequestError(ErrorCode.BAD_REQUEST, "EAGLE-3 needs a draft-vocab mapping: call set_vocab_mapping")
        with self._mapping_lock:
            mapping = self._mappings.get(digest)
        if mapping is None:
            # The broker sends mappings ahead of requests; missing means a race
            # with a restart. INTERNAL makes the client retry.
            raise RequestError(ErrorCode.INTERNAL, f"worker {self.name} lacks vocab mapping {digest}")
        return mapping
