"""A worker: one target replica (one GPU) serving supervision for the broker.

Two threads. The I/O thread owns every socket: it registers with the broker,
heartbeats (so a long forward never looks like death), receives requests, and
sends each reply straight to the requesting client's data socket before
telling the broker DONE. The compute thread runs the engine, one batch at a
time, and hands encoded replies back through a queue plus an inproc wake-up.

The parts, one module each: ``session`` (the broker session), ``replies`` (data sockets and reply
delivery), ``compute`` (the compute thread and batching), ``executor`` (a job on the engine, and its
reply's payload), ``vocab_store``, ``nccl_pair`` and ``faults`` (test-only fault injection).
``Worker`` composes them; its ``run`` is the I/O thread's busy loop.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from typing import cast

import torch
import zmq

from spec_serve.engines.base import PackingEngine, TargetEngine
from spec_serve.protocol.commands import (
    BACKEND_PORT,
    HEARTBEAT_INTERVAL,
    HEARTBEAT_LIVENESS,
    WORKER_PORT_HINT,
    Message,
    ProtocolError,
    WorkerCommand,
)
from spec_serve.protocol.messages import Release
from spec_serve.supervision.contract import Kind
from spec_serve.telemetry.logs import event
from spec_serve.transport import samehost
from spec_serve.transport.hostpool import HostBufferPool
from spec_serve.transport.sockets import DEFAULT_MAX_MESSAGE_BYTES, Security, check_connect_url
from spec_serve.worker.compute import ComputeLoop
from spec_serve.worker.executor import Executor
from spec_serve.worker.faults import Faults
from spec_serve.worker.jobs import Job, Result
from spec_serve.worker.nccl_pair import PairBinding
from spec_serve.worker.replies import DataSockets, Outbox
from spec_serve.worker.session import BrokerSession, WorkerRefused
from spec_serve.worker.threads import ThreadShare
from spec_serve.worker.vocab_store import VocabStore

__all__ = ["PROBE_TOKENS", "Job", "Result", "Worker", "WorkerRefused", "probe_engine"]

log = logging.getLogger("spec_serve.worker")

# Tokens in the load-time probe's forward (probe_engine).
PROBE_TOKENS = 4
# How long a worker whose engine died lets its last error replies and LEAVE drain before closing.
LEAVE_LINGER_MS = 2000


def probe_engine(engine: TargetEngine) -> None:
    """One tiny forward (``PROBE_TOKENS`` tokens, EAGLE-3 compact: every layer and the lm_head) before
    the worker registers, so an engine that cannot serve this target fails at load, not on a client's
    request. Raises whatever the engine raises."""
    vocab = engine.target_info().vocab_size
    ids = (torch.arange(PROBE_TOKENS, dtype=torch.int64) % vocab).unsqueeze(0)
    ones = torch.ones_like(ids)
    engine.generate_batch(ids, ones, ones, kind=Kind.EAGLE3_COMPACT.value)


def _check_packing(engine: TargetEngine, packing: bool, max_batch_tokens: int) -> None:
    """``ValueError`` unless the packing settings hold together and ``engine`` can run packed forwards
    (the hf engine, on a model that allows it) when packing is on."""
    if max_batch_tokens < 0:
        raise ValueError("max_batch_tokens must be >= 0 (0: each request packed alone)")
    if max_batch_tokens and not packing:
        raise ValueError("max_batch_tokens is the token budget of packed forwards: turn packing on "
                         "(--packing) or leave it at 0")
    if not packing:
        return
    if not hasattr(engine, "generate_packed"):
        raise ValueError(f"packing needs the hf engine; engine {getattr(engine, 'engine', type(engine).__name__)!r} "
                         f"has no packed forward (leave --packing off)")
    # cast: the hasattr check above is the test (an engine need not subclass the protocol)
    reason = cast(PackingEngine, engine).packing_unsupported()
    if reason is not None:
        raise ValueError(f"packing is not possible for this model: {reason} (leave --packing off)")


def _host_pool(device: torch.device, host_pool: bool | None, buffers: int | None,
               capacity: int) -> HostBufferPool | None:
    """Replies are copied into pooled (pinned) host slabs, each reused once ZeroMQ has let go of every
    frame that borrows it. On by default for GPU outputs; host_pool=True also pools a CPU engine's
    outputs (SPEC_SERVE_HOST_POOL=1), so the reuse rules run in CPU tests; False: fresh host tensors."""
    if buffers is not None and buffers < 1:
        raise ValueError("host_pool_buffers must be >= 1")
    pooled = device.type == "cuda" if host_pool is None else bool(host_pool)
    if not pooled:
        return None
    return HostBufferPool(max_buffers=buffers or capacity + 2, copy_host_tensors=device.type != "cuda")


class Worker:
    """Serve ``engine`` to the broker at ``broker_url`` under ``service``."""

    def __init__(
        self,
        engine: TargetEngine,
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
        """Builds the parts; a constructor argument goes to the part that uses it."""
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        _check_packing(engine, packing, max_batch_tokens)
        self.device = device = torch.device(getattr(engine, "device", "cpu"))
        self.broker_url = check_connect_url(broker_url, WORKER_PORT_HINT, BACKEND_PORT)
        self.service = service
        self.ctx = context or zmq.Context.instance()
        identity = uuid.uuid4().bytes
        self.name = identity.hex()[:12]
        self._stop = threading.Event()
        faults = Faults()
        self.vocab = VocabStore(self.name, capacity, max_message_bytes)
        self.pair = PairBinding(self.name, device, self.broker_url, advertise_host, security, faults)
        self.executor = Executor(engine, self.name, packing=bool(packing), vocab=self.vocab, pair=self.pair,
                                 faults=faults, host_pool=_host_pool(device, host_pool, host_pool_buffers, capacity),
                                 device=device, max_message_bytes=max_message_bytes)
        self.compute = ComputeLoop(self.ctx, f"inproc://spec-serve-worker-{self.name}", self.executor, self.pair,
                                   packing=bool(packing), max_batch_tokens=int(max_batch_tokens), threads=threads)
        self.data_sockets = DataSockets(self.ctx, security, reply_timeout)
        self.session = BrokerSession(
            self.ctx, identity, self.name, self.broker_url, service, security=security, info=engine.target_info(),
            capacity=capacity, max_message_bytes=max_message_bytes, heartbeat_interval=heartbeat_interval,
            liveness=liveness, before_ready=self._before_ready,
            handlers={WorkerCommand.REQUEST: self._on_request, WorkerCommand.BIND: self._on_bind,
                      WorkerCommand.RELEASE: self._on_release, WorkerCommand.SET_VOCAB: self.vocab.store})
        self.outbox = Outbox(self.data_sockets, self.session.send_done)
        # run() owns the same-host plane: it creates the shared-memory segments and closes them on the way
        # out, so a Worker that is built but never run holds none.
        self._plane_shape = (plane_slots or capacity + 2, plane_lease)
        self._heartbeat_interval = heartbeat_interval

    # ------------------------------------------------- what callers read and set

    @property
    def engine(self) -> TargetEngine:
        return self.executor.engine

    @engine.setter
    def engine(self, engine: TargetEngine) -> None:  # from the next job on, the worker serves (and reports) this engine
        self.executor.engine = engine

    @property
    def engine_error(self) -> str | None:
        """Why the engine died (set once); None while it serves."""
        return self.executor.engine_error

    @property
    def plane(self) -> samehost.WorkerPlane | None:
        return self.executor.plane

    @property
    def host_pool(self) -> HostBufferPool | None:
        return self.executor.host_pool

    @property
    def max_batch_tokens(self) -> int:
        return self.compute.max_batch_tokens

    @max_batch_tokens.setter
    def max_batch_tokens(self, tokens: int) -> None:
        self.compute.max_batch_tokens = tokens

    def serve(self, job: Job) -> Result:
        """Run one job on the engine, in the caller's thread; every failure becomes an error reply."""
        return self.executor.serve(job)

    def serve_group(self, jobs: list[Job]) -> list[Result]:
        """Serve jobs with one packed forward, in the caller's thread; one result per job."""
        return self.executor.serve_group(jobs)

    # ------------------------------------------------------ the I/O busy loop

    def run(self) -> None:
        """Serve until ``stop()`` (or, once the engine died, until its last answers are out)."""
        self.executor.plane = samehost.WorkerPlane.start(self.device, *self._plane_shape)
        wake = self.ctx.socket(zmq.PAIR)
        wake.bind(self.compute.wake_endpoint)
        self.compute.start()
        poller = zmq.Poller()
        poller.register(wake, zmq.POLLIN)
        self.session.open(poller)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(5 if self.outbox.busy else int(self._heartbeat_interval * 250)))
                now = time.monotonic()
                if self.session.sock in events:
                    self.session.receive(now)
                self._collect_results(wake, wake in events, now)
                self.outbox.flush(now)
                if self._answered_all():
                    self.session.leave(self.engine_error)  # in-flight requests go to other workers
                    break
                self._keep_alive(now)
        except WorkerRefused as e:
            event(log, logging.ERROR, "worker.refused", worker=self.name, service=self.service, error=e)
            raise
        finally:
            self._shutdown(wake)

    def stop(self) -> None:
        self._stop.set()

    def _collect_results(self, wake: zmq.Socket, woken: bool, now: float) -> None:
        """Queue the compute thread's results for delivery; a dead engine's last answers never wait."""
        if not woken and self.engine_error is None:
            return
        while True:
            try:
                wake.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        for result in self.compute.results():
            self.outbox.add(result, now)

    def _answered_all(self) -> bool:
        """The engine died and every answer it owes is out: time to leave the pool."""
        return self.engine_error is not None and self.compute.drained and self.outbox.empty

    def _keep_alive(self, now: float) -> None:
        """Heartbeat the broker (closing idle data sockets at the same pace); reconnect if it went silent."""
        if self.session.keep_alive(now):
            self.data_sockets.close_idle(now)

    def _shutdown(self, wake: zmq.Socket) -> None:
        self.compute.finish()
        linger = LEAVE_LINGER_MS if self.engine_error is not None else 0
        self.session.close(linger)
        wake.close(0)
        self.data_sockets.close_all(linger)
        if self.executor.plane is not None:
            self.executor.plane.close()
            self.executor.plane = None
        event(log, logging.INFO, "worker.stop", served=self.outbox.served, replies_plane=self.outbox.replies_plane,
              replies_frames=self.outbox.replies_frames)

    # ---------------------------------------------------- the broker's commands

    def _on_request(self, msg: Message) -> None:
        if not msg.request_id:
            raise ProtocolError("REQUEST without reply_to or request id")
        job = Job(msg.request_id, msg.header, msg.payload, time.monotonic())  # raises without a reply_to
        self.compute.submit(job)
        with contextlib.suppress(Exception):  # connect now, while the forward runs (errors: when replying)
            self.data_sockets.get(*job.reply_route, time.monotonic())

    def _on_bind(self, msg: Message) -> None:
        if not msg.request_id:
            raise ProtocolError("BIND without reply_to, prefix or request id")
        self.compute.submit(Job(msg.request_id, msg.header, [], time.monotonic(), control="bind"))  # checks it

    def _on_release(self, msg: Message) -> None:
        self._release(Release.from_json(msg.header).prefix)

    def _release(self, prefix: str | None) -> None:
        """The binding ``prefix`` ended; queued sends to it are skipped, the pair closed in order."""
        if prefix is not None:
            self.pair.mark_released(prefix)
            self.compute.submit(Job(b"", Release(prefix).to_json(), [], time.monotonic(), control="release"))

    def _before_ready(self) -> bool:
        """Before each READY: False once the engine died (it never registers again); otherwise forget
        what the broker forgets with a new registration (our binding, our vocab mappings)."""
        if self.engine_error is not None:
            return False
        if self.pair.prefix is not None:
            self._release(self.pair.prefix)
        self.vocab.clear()
        return True
