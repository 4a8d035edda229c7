"""The worker's side of an NCCL binding (docs/nccl.md): at most one client bound at a time.

The pair group is used only on the compute thread, in order with the jobs around a bind or release;
the I/O thread only records released prefixes (``mark_released``), so queued sends to them are skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from spec_serve.paths.faults import Faults
from spec_serve.paths.nccl.pairgroup import PairGroup
from spec_serve.protocol.commands import ErrorCode, Status
from spec_serve.protocol.messages import BindGrant, Rendezvous, WorkerBind
from spec_serve.telemetry.logs import event
from spec_serve.transport.sockets import Security, route_address
from spec_serve.worker.jobs import Job, RequestError, Result, error_result

log = logging.getLogger("spec_serve.worker")


class PairBinding:
    def __init__(self, worker: str, device: torch.device, broker_url: str, advertise_host: str | None,
                 security: Security | None, faults: Faults):
        self.worker = worker
        self.device = device
        self.broker_url = broker_url
        self.advertise_host = advertise_host  # where the bound client reaches our rendezvous store
        self.security = security
        self.faults = faults
        self._pair: PairGroup | None = None
        self._client: str | None = None
        self.prefix: str | None = None  # the bound binding's, read by the I/O thread when registering anew
        self._released: set[str] = set()
        self.sent = 0
        self.sent_bytes = 0  # reply payload sent over pair groups

    def mark_released(self, prefix: str) -> None:
        """I/O thread: the binding ``prefix`` ended (its release job closes the pair in order)."""
        self._released.add(prefix)

    def control(self, job: Job, post: Callable[[Result], None]) -> None:
        """Compute thread: bind (host the store, tell the client through ``post``, form the group) or release."""
        if job.control == "release":
            if job.release.prefix == self.prefix:
                self.close("released")
            return
        bind = job.bind
        prefix, timeout = bind.prefix, float(bind.timeout)
        self.close("rebound")
        if prefix in self._released:  # released before we got to it
            self._released.discard(prefix)
            return
        refusal = self._refusal(bind)
        if refusal is not None:
            post(error_result(job, self.worker, ErrorCode.UNAVAILABLE, refusal))
            return
        self._bind(job, bind, timeout, post)

    def _refusal(self, bind: WorkerBind) -> str | None:
        """Why this worker cannot bind the client of ``bind``; None if it can."""
        if self.security is not None:
            return (f"worker {self.worker} runs CURVE: an NCCL binding's rendezvous (TCPStore, gloo/NCCL "
                    f"connections) is not authenticated, so it is refused; replies go as CURVE frames")
        if bind.device_type != self.device.type:
            return (f"worker device is {self.device.type}, client device is {bind.device_type}: "
                    f"the pair group needs both on CUDA (NCCL) or both on CPU (gloo)")
        return None

    def _bind(self, job: Job, bind: WorkerBind, timeout: float, post: Callable[[Result], None]) -> None:
        prefix = bind.prefix
        try:
            if self.advertise_host is None:
                self.advertise_host = route_address(self.broker_url)
            store, port = PairGroup.host_store(self.advertise_host, 0, timeout)
        except Exception as e:
            post(error_result(job, self.worker, ErrorCode.UNAVAILABLE, f"could not host the rendezvous store: {e}"))
            return
        rendezvous = Rendezvous(store_host=self.advertise_host, store_port=port, prefix=prefix, worker=self.worker,
                                timeout=timeout)
        post(Result(job, Status.OK, BindGrant(worker=self.worker, bind=rendezvous), []))
        try:
            pair = PairGroup.create(self.advertise_host, port, 0, device=self.device, prefix=prefix, timeout=timeout,
                                    store=store, listen_host=self.advertise_host)
        except Exception as e:  # the client falls back to frames on its side
            event(log, logging.WARNING, "worker.nccl_bind_failed", client=bind.client[:12], error=e)
            return
        self._pair, self._client, self.prefix = pair, bind.client, prefix
        event(log, logging.INFO, "worker.nccl_bound", client=bind.client[:12],
              backend="nccl" if self.device.type == "cuda" else "gloo", device=self.device)

    def check(self, job: Job) -> None:
        """``RequestError`` (UNAVAILABLE) unless ``job``'s client is bound to a live pair group."""
        if self._pair is None or self._pair.closed or self.prefix in self._released:
            raise RequestError(ErrorCode.UNAVAILABLE, f"worker {self.worker} has no live pair group")
        if job.request.client != self._client:
            raise RequestError(ErrorCode.UNAVAILABLE, f"worker {self.worker} is not bound to this client")

    def send(self, results: list[Result]) -> None:
        """Compute thread, after the results' headers were posted: send the bound replies' tensors."""
        for result in results:
            tensors, result.send = result.send, None
            if tensors is None:
                continue
            pair = self._pair
            try:
                if pair is None or self.prefix in self._released:
                    raise RuntimeError("binding released before the send")
                if self.faults.fail_nccl_send():
                    pair.abort()
                    raise RuntimeError("SPEC_SERVE_TEST_FAIL_NCCL_SEND: send aborted (test hook)")
                pair.send_tensors(tensors)
                self.sent += 1
                self.sent_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
            except Exception as e:  # PairGroupError aborted the group: the client re-sends as frames
                event(log, logging.WARNING, "worker.nccl_send_failed", request=result.job.request_id.hex()[:12],
                      error=e)
                self.close("send failed")

    def close(self, reason: str) -> None:
        pair, self._pair = self._pair, None
        if pair is not None:
            pair.close()
            event(log, logging.INFO, "worker.nccl_unbound", client=str(self._client)[:12], reason=reason,
                  sent=self.sent)
        if self.prefix is not None:
            self._released.discard(self.prefix)
        self._client = self.prefix = None
