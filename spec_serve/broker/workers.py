"""The worker registry: who is registered, under which service, serving which target.

A worker registers with READY (checked here: target info, capacity, the service's target) and is
removed with a reason (heartbeat expired, left, re-registered, unreachable) that the log line names.
What happens to the requests it held is dispatch.py's job, to its binding binding.py's.
"""

from __future__ import annotations

import logging
import time

from spec_serve.broker.context import BrokerContext
from spec_serve.broker.services import ServiceQueues
from spec_serve.broker.state import ServiceState, WorkerState
from spec_serve.protocol.commands import WORKER_TAG, Message, ProtocolError, WorkerCommand, control, encode_header
from spec_serve.protocol.messages import Ready, Refused
from spec_serve.supervision.target_info import TargetInfo
from spec_serve.telemetry.logs import event

log = logging.getLogger("spec_serve.broker")

# A worker's target info as sent in READY; real ones are a few hundred bytes.
MAX_TARGET_INFO_BYTES = 8 << 10
# Requests one worker may hold at once, whatever it claims: a claim of 10^6 must not draw the queue.
MAX_WORKER_CAPACITY = 64


class WorkerRegistry:
    """Registered workers by identity; each also listed in its service's ``workers``."""

    def __init__(self, ctx: BrokerContext, services: ServiceQueues):
        self.ctx = ctx
        self.services = services
        self.workers: dict[bytes, WorkerState] = {}

    def get(self, identity: bytes) -> WorkerState | None:
        return self.workers.get(identity)

    def seen(self, identity: bytes, now: float) -> WorkerState | None:
        """The registered worker that sent a message now, its expiry extended; None if unknown."""
        worker = self.workers.get(identity)
        if worker is not None:
            worker.expiry = now + self.ctx.expiry_window
        return worker

    def of(self, service: ServiceState) -> list[WorkerState]:
        return [self.workers[i] for i in service.workers]

    def serving_fingerprint(self, name: str) -> str | None:
        """The target fingerprint the workers of service ``name`` serve; None while it has none."""
        service = self.services.get(name)
        return self.workers[service.workers[0]].info.get("fingerprint") if service and service.workers else None

    def register(self, identity: bytes, msg: Message, ready: Ready, now: float,
                 pinned: list[str]) -> WorkerState | None:
        """READY: the new worker, or None after refusing it (its target is not the service's). ``pinned``: the
        fingerprint each connected client of the service set up with."""
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
        service = self.services.service(msg.service, now)
        conflict = self.target_conflict(service, target, pinned)
        if conflict is not None:
            self.refuse(identity, service, conflict)
            return None
        worker = WorkerState(identity, msg.service, info, capacity, now + self.ctx.expiry_window, time.time(),
                             idle_since=now, max_message_bytes=ready.max_message_bytes,
                             host=ready.host[:256] if ready.host else None, host_key=ready.host_key,
                             pid=ready.pid)
        self.workers[identity] = worker
        service.workers.append(identity)
        self.services.remember_served(msg.service)
        if service.vocab_size is None and isinstance(info.get("vocab_size"), int):
            service.vocab_size = info["vocab_size"]
        self.ctx.metrics.workers.labels(service=msg.service).set(len(service.workers))
        event(log, logging.INFO, "broker.worker_ready", worker=worker.name, service=msg.service,
              engine=info.get("engine"), capacity=capacity)
        self.ctx.status_stale = True
        return worker

    def target_conflict(self, service: ServiceState, info: TargetInfo, pinned: list[str]) -> str | None:
        """Why a worker serving ``info`` may not join ``service``, or None.

        The service's target is what its workers serve (they must agree on everything but the engine)
        and, while the service has no worker, the fingerprint every known client of it set up with
        (``pinned``): the target cannot change under a client (docs/failure-semantics.md)."""
        if service.workers:
            first = self.workers[service.workers[0]]
            diff = TargetInfo.from_dict(first.info).mismatches(info, ignore=("engine",))
            if not diff:
                return None
            fields = "; ".join(f"{k}: serving={a!r} new={b!r}" for k, (a, b) in diff.items())
            return f"service {service.name!r} is served by another target (worker {first.name}): {fields}"
        others = [f for f in pinned if f != info.fingerprint]
        if not others:
            return None
        return (f"{len(others)} connected client(s) of service {service.name!r} set up with target fingerprint "
                f"{', '.join(sorted(set(others)))}; this worker serves {info.fingerprint}")

    def refuse(self, identity: bytes, service: ServiceState, reason: str) -> None:
        message = (f"{reason}. Serve this checkpoint under another --service, or stop every worker and client "
                   f"of {service.name!r} first")
        self.ctx.metrics.refused_workers.labels(service=service.name).inc()
        event(log, logging.ERROR, "broker.worker_refused", worker=identity.hex()[:12], service=service.name,
              reason=message)
        self.ctx.to_worker(identity, control(WORKER_TAG, WorkerCommand.REFUSED.value, service.name,
                                             header=Refused(error=message)))

    def remove(self, worker: WorkerState, reason: str) -> ServiceState:
        """Forget ``worker`` (its ``reason`` goes to the log line); returns its service. Its requests and
        binding are the caller's to settle."""
        self.workers.pop(worker.identity, None)
        service = self.services[worker.service]
        if worker.identity in service.workers:
            service.workers.remove(worker.identity)
        self.ctx.metrics.workers.labels(service=worker.service).set(len(service.workers))
        event(log, logging.WARNING, "broker.worker_gone", worker=worker.name, service=worker.service, reason=reason)
        self.ctx.status_stale = True
        return service
