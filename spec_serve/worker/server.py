"""A worker: one target replica (one GPU) serving supervision for the broker.

Two threads. The I/O thread owns every socket: it registers with the broker,
heartbeats (so a long forward never looks like death), receives requests, and
sends each reply straight to the requesting client's data socket before
telling the broker DONE. The compute thread runs the engine, one batch at a
time, and hands encoded replies back through a queue plus an inproc wake-up.

The parts, one module each: ``session`` (the broker session), ``replies`` (data sockets and reply
delivery), ``compute`` (the compute thread and batching), ``executor`` (a job on the engine, handed to
its reply path), ``vocab_store``; the reply paths' worker halves (spec_serve/paths, ``self.paths``).
``Worker`` composes them; its ``run`` is the I/O thread's busy loop. ``paths.close()`` releases what
every reply path holds (pair group, shared memory, CUDA IPC handles); ``run`` calls it on the way out.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
import uuid
from typing import Any, cast

import torch
import zmq

from spec_serve.engines.base import PackingEngine, TargetEngine
from spec_serve.paths.base import WorkerSetup
from spec_serve.paths.faults import Faults
from spec_serve.paths.frames.hostpool import HostBufferPool
from spec_serve.paths.plane import samehost
from spec_serve.paths.plane.worker import PlaneWorker
from spec_serve.paths.registry import WorkerPaths
from spec_serve.protocol.commands import (
    BACKEND_PORT,
    HEARTBEAT_INTERVAL,
    HEARTBEAT_LIVENESS,
    WORKER_PORT_HINT,
    Message,
    ProtocolError,
    WorkerCommand,
)
from spec_serve.protocol.messages import Done
from spec_serve.supervision.contract import Kind
from spec_serve.telemetry.logs import event
from spec_serve.telemetry.metrics import WorkerMetrics
from spec_serve.transport.sockets import DEFAULT_MAX_MESSAGE_BYTES, Security, check_connect_url
from spec_serve.worker.compute import ComputeLoop
from spec_serve.worker.drain import DEFAULT_DRAIN_TIMEOUT_S, Drain
from spec_serve.worker.executor import Executor
from spec_serve.worker.health import device_memory
from spec_serve.worker.jobs import Job, Result
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
# How long a stopping worker waits for the broker to confirm its final LEAVE.
LEAVE_CONFIRM_S = 2.0


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
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S,
        insecure_network: bool = False,
    ):
        """Builds the parts; a constructor argument goes to the part that uses it. ``insecure_network``:
        its listeners (the NCCL rendezvous) may bind beyond loopback without authentication."""
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        if drain_timeout < 0:
            raise ValueError("drain_timeout must be >= 0 seconds")
        _check_packing(engine, packing, max_batch_tokens)
        self.device = device = torch.device(getattr(engine, "device", "cpu"))
        self.broker_url = check_connect_url(broker_url, WORKER_PORT_HINT, BACKEND_PORT)
        self.service = service
        self.ctx = context or zmq.Context.instance()
        identity = uuid.uuid4().bytes
        self.name = identity.hex()[:12]
        self._stop = threading.Event()
        self.drain = Drain(drain_timeout)
        faults = Faults()
        self.vocab = VocabStore(self.name, capacity, max_message_bytes)
        # The device->host copy of a reply runs on its own stream, so the next forward starts at once
        # instead of waiting for it (the I/O thread sends the reply when the copy's event completes).
        copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.host_pool = _host_pool(device, host_pool, host_pool_buffers, capacity)
        self.paths = WorkerPaths(WorkerSetup(self.name, device, self.broker_url, advertise_host, security, faults,
                                             self.host_pool, copy_stream, plane_slots or capacity + 2, plane_lease,
                                             insecure_network))
        self.executor = Executor(engine, self.name, packing=bool(packing), vocab=self.vocab, paths=self.paths,
                                 max_message_bytes=max_message_bytes)
        self.compute = ComputeLoop(self.ctx, f"inproc://spec-serve-worker-{self.name}", self.executor, self.paths,
                                   packing=bool(packing), max_batch_tokens=int(max_batch_tokens), threads=threads)
        self.data_sockets = DataSockets(self.ctx, security, reply_timeout)
        self.session = BrokerSession(
            self.ctx, identity, self.name, self.broker_url, service, security=security, info=engine.target_info(),
            capacity=capacity, max_message_bytes=max_message_bytes, heartbeat_interval=heartbeat_interval,
            liveness=liveness, before_ready=self._before_ready,
            handlers={WorkerCommand.REQUEST: self._on_request, WorkerCommand.SET_VOCAB: self.vocab.store,
                      **self.paths.handlers(self._submit_control)})
        self.outbox = Outbox(self.data_sockets, self._done)
        self._counts_lock = threading.Lock()  # the I/O thread counts DONEs; the HTTP thread reads them
        self._done_counts: collections.Counter[str] = collections.Counter()  # by DONE status, "tokens", "bytes:<plane>"
        self.metrics = WorkerMetrics(self.figures, compile_report=lambda: getattr(self.engine, "compile_report", None))
        self.compute.on_forward = self.metrics.forward_seconds.observe
        # run() starts the paths (the same-host plane creates its shared-memory segments) and closes them on
        # the way out, so a Worker that is built but never run holds none.
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
        """The same-host plane's slots while the worker runs (None: not running, or the plane is off)."""
        side = self.paths.named("plane")
        return side.plane if isinstance(side, PlaneWorker) else None

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
        """Serve until ``stop()``, the end of a drain (``begin_drain``), or (once the engine died) its last answers."""
        self.paths.start()
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
                self.session.receive(now)  # every turn, until a read finds nothing (transport/ingress.py)
                self._collect_results(wake, wake in events, now)
                self.outbox.flush(now)
                if self._answered_all():
                    self.session.leave(self.engine_error)  # in-flight requests go to other workers
                    event(log, logging.ERROR, "worker.left_pool", worker=self.name,
                          reason=f"engine dead: {self.engine_error}")
                    self.drain.left = True
                    break
                if self._drain_over(now):
                    break
                self._keep_alive(now)
        except WorkerRefused as e:
            event(log, logging.ERROR, "worker.refused", worker=self.name, service=self.service, error=e)
            raise
        finally:
            self._shutdown(wake)

    def stop(self) -> None:
        """Stop at once (thread-safe): what we hold goes back to the broker, which gives it to other workers."""
        self._stop.set()

    def begin_drain(self, reason: str) -> None:
        """Stop gracefully (thread- and signal-safe): leave the pool at once, finish or hand back what we hold
        within ``drain_timeout``, release what we lent, and return from ``run``."""
        self.drain.request(reason)

    @property
    def state(self) -> str:
        """``serving`` (registered, taking requests), ``disconnected`` (not registered yet, or the broker is
        lost), ``draining``, ``stopping``, or ``engine_dead`` (telemetry.metrics.WORKER_STATES)."""
        if self.engine_error is not None:
            return "engine_dead"
        if self._stop.is_set() or self.drain.outcome is not None:
            return "stopping"
        if self.drain.reason is not None:
            return "draining"
        return "serving" if self.session.registered else "disconnected"

    def figures(self) -> dict[str, Any]:
        """What ``/metrics`` shows (telemetry.metrics.WorkerMetrics); safe to call from another thread."""
        with self._counts_lock:
            counts = dict(self._done_counts)
        requests = {k: v for k, v in counts.items() if k != "tokens" and not k.startswith("bytes:")}
        reply_bytes = {k[len("bytes:"):]: v for k, v in counts.items() if k.startswith("bytes:")}
        reply_bytes.update(self.paths.sent_apart())  # NCCL's tensors: DONE counts only data messages
        info = self.engine.target_info()
        return {"info": {"worker": self.name, "service": self.service, "engine": info.engine, "model": info.model_name},
                "requests": requests, "tokens": counts.get("tokens", 0), "reply_bytes": reply_bytes,
                "digests": self.executor.digests, "queue_depth": self.compute.queued,
                "host_slabs": self.host_pool.allocations if self.host_pool else 0,
                "host_slab_seconds": self.host_pool.allocation_seconds if self.host_pool else 0.0,
                "in_forward": int(self.compute.forwarding), "device_memory": device_memory(self.device),
                "state": self.state}

    def _done(self, request_id: bytes, done: Done) -> None:
        """Tell the broker DONE, and count it for /metrics."""
        with self._counts_lock:
            self._done_counts[done.status] += 1
            self._done_counts["tokens"] += done.tokens or 0
            if done.nbytes:
                self._done_counts[f"bytes:{done.via or 'frames'}"] += done.nbytes
        self.session.send_done(request_id, done)

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

    # ------------------------------------------------------------- draining

    def _drain_over(self, now: float) -> bool:
        """Drive a requested drain: begin it, and True once nothing is held any more or its time is up."""
        if self.drain.reason is None:
            return False
        if not self.drain.started:
            self._begin_drain(now)
        if self._holds_nothing(now):
            self.drain.outcome = "drained"
            return True
        if now >= self.drain.deadline:
            self.drain.outcome = f"drain timed out after {self.drain.timeout:g}s"
            return True
        return False

    def _begin_drain(self, now: float) -> None:
        """Tell the broker (no more requests), hand back what the compute thread has not started, and let
        that thread end after the forward it runs."""
        self.session.leave(self.drain.reason, drain=True)
        self.drain.start(now)
        self.paths.begin_drain()
        for job in self.compute.take_queued():
            self._hand_back(job)
        self.compute.finish()
        event(log, logging.INFO, "worker.draining", worker=self.name, reason=self.drain.reason,
              timeout_s=self.drain.timeout, handed_back=self.drain.handed_back,
              running=int(self.compute.forwarding), unsent=self.data_sockets.unsent(now), lent=self._lent_out())

    def _hand_back(self, job: Job) -> None:
        """A request we will not run: the broker gives it to another worker at once."""
        self._done(job.request_id, Done(status="returned"))
        self.drain.handed_back += 1

    def _holds_nothing(self, now: float) -> bool:
        """No forward, no reply waiting or still leaving, no same-host slot lent out."""
        return (self.compute.drained and not self.outbox.busy and self.data_sockets.unsent(now) == 0
                and self._lent_out() == 0)

    def _lent_out(self) -> int:
        return self.paths.lent_out()

    def _keep_alive(self, now: float) -> None:
        """Heartbeat the broker (closing idle data sockets at the same pace); reconnect if it went silent."""
        if self.session.keep_alive(now):
            self.data_sockets.close_idle(now)

    def _shutdown(self, wake: zmq.Socket) -> None:
        """Leave the pool for good (unless the engine's death did), then release everything we own: the
        NCCL pair (once the compute thread is out of it), the sockets, the same-host plane's segments and
        CUDA IPC handles. A forward still running is abandoned: the broker gave its request to another."""
        self.compute.finish()
        if not self.drain.left and self.session.registered:
            self.session.leave(self._stop_reason())
            self.drain.left = True
            self.drain.confirmed = self.session.confirm_left(LEAVE_CONFIRM_S)
        computing = not self.compute.join(0.5)
        linger = LEAVE_LINGER_MS if self.engine_error is not None else 0
        self.session.close(linger)
        wake.close(0)
        self.data_sockets.close_all(linger)
        self.paths.close()  # waits for an NCCL transfer in progress; an abandoned forward's reply goes nowhere
        event(log, logging.INFO, "worker.stop", served=self.outbox.served,
              replies=",".join(f"{via}:{n}" for via, n in sorted(self.outbox.replies.items())) or "0",
              handed_back=self.drain.handed_back,
              outcome=self.drain.outcome or ("stopped at once" if self._stop.is_set() else "left"),
              abandoned_forward=int(computing))

    def _stop_reason(self) -> str:
        if self.drain.outcome is not None:
            return f"stopped: {self.drain.outcome}"
        return "stopped at once" + (f" (drain: {self.drain.reason})" if self.drain.reason else "")

    # ---------------------------------------------------- the broker's commands

    def _on_request(self, msg: Message) -> None:
        if not msg.request_id:
            raise ProtocolError("REQUEST without reply_to or request id")
        job = Job(msg.request_id, msg.header, msg.payload, time.monotonic())  # raises without a reply_to
        if self.drain.started:  # sent before the broker read our LEAVE
            self._hand_back(job)
            return
        self.compute.submit(job)
        with contextlib.suppress(Exception):  # connect now, while the forward runs (errors: when replying)
            self.data_sockets.get(*job.reply_route, time.monotonic())

    def _submit_control(self, control: str, request_id: bytes, header: dict) -> None:
        """Queue a reply path's control job (its message checked here: a bad one raises, answered by the session)."""
        message = self.paths.control_messages[control].from_json(header)
        self.compute.submit(Job(request_id, header, [], time.monotonic(), control=control, message=message))

    def _before_ready(self) -> bool:
        """Before each READY: False once the engine died or a drain began (it never registers again); otherwise forget
        what the broker forgets with a new registration (our binding, our vocab mappings)."""
        if self.engine_error is not None or self.drain.reason is not None:
            return False
        self.paths.before_ready(self._submit_control)
        self.vocab.clear()
        return True
