"""The worker's side of an NCCL binding (docs/nccl.md): at most one client bound at a time.

The broker's BIND and RELEASE arrive on the I/O thread, which queues them as control jobs, so the pair
group is formed, used and closed only on the compute thread, in order with the requests around them;
the I/O thread only records released prefixes, so queued sends to them are skipped. A bound request's
reply is a header (``path["nccl"]``: the tensors' specs; no payload) and, once it is posted, its tensors
over the pair group.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar
from urllib.parse import urlsplit

import torch

from spec_serve.paths.base import Delivery, Outgoing, PathUnavailable, Post, SubmitControl, WorkerSide
from spec_serve.paths.faults import Faults
from spec_serve.paths.nccl.binding import encode_specs
from spec_serve.paths.nccl.messages import NcclDescriptor, NcclOffer
from spec_serve.paths.nccl.pairgroup import PairGroup
from spec_serve.protocol.commands import ErrorCode, Message, ProtocolError, Status, WorkerCommand
from spec_serve.protocol.messages import (
    BindGrant,
    ErrorReply,
    Release,
    Rendezvous,
    Reply,
    SupervisionRequest,
    WireMessage,
    WorkerBind,
)
from spec_serve.telemetry.logs import event
from spec_serve.transport.sockets import (
    ExposureError,
    Security,
    address_family,
    check_exposure,
    local_host_key,
    route_address,
)

log = logging.getLogger("spec_serve.worker")


class NcclWorker(WorkerSide):
    name: ClassVar[str] = "nccl"
    sends_apart: ClassVar[bool] = True
    packs: ClassVar[bool] = False  # each reply's tensors go as the engine left them, over the pair group
    sends_fp8: ClassVar[bool] = False  # the pair group carries the model dtype; the client counts the decline
    control_messages: ClassVar[Mapping[str, type[WireMessage]]] = {"bind": WorkerBind, "release": Release}

    def __init__(self, worker: str, device: torch.device, broker_url: str, advertise_host: str | None,
                 security: Security | None, faults: Faults, *, insecure_network: bool = False):
        self.worker = worker
        self.device = device
        self.broker_url = broker_url
        self.advertise_host = advertise_host  # where the bound client reaches our rendezvous store
        self.security = security
        self.insecure_network = insecure_network  # the rendezvous may listen beyond loopback unauthenticated
        self.faults = faults
        self.host = local_host_key()
        self._pair: PairGroup | None = None
        self._client: str | None = None
        self.prefix: str | None = None  # the bound binding's, read by the I/O thread when registering anew
        self._released: set[str] = set()
        self._lock = threading.Lock()  # a transfer, or closing the group (close may come from another thread)
        self.sent = 0
        self.sent_bytes = 0  # reply payload sent over pair groups
        self._draining = False
        self._closed = False  # close() ran: a group formed after it is closed at once

    # ------------------------------------------------------------- I/O thread

    def handlers(self, submit: SubmitControl) -> dict[WorkerCommand, Callable[[Message], None]]:
        return {WorkerCommand.BIND: functools.partial(self._on_bind, submit),
                WorkerCommand.RELEASE: functools.partial(self._on_release, submit)}

    def _on_bind(self, submit: SubmitControl, msg: Message) -> None:
        if not msg.request_id:
            raise ProtocolError("BIND without reply_to, prefix or request id")
        if self._draining:  # the broker ended this binding when it read our LEAVE, and told the client
            return
        submit("bind", msg.request_id, msg.header)  # checked when the job is made

    def _on_release(self, submit: SubmitControl, msg: Message) -> None:
        self._release(Release.from_json(msg.header).prefix, submit)

    def _release(self, prefix: str | None, submit: SubmitControl) -> None:
        """The binding ``prefix`` ended; queued sends to it are skipped, the pair closed in order."""
        if prefix is not None:
            self._released.add(prefix)
            submit("release", b"", Release(prefix).to_json())

    def begin_drain(self) -> None:
        self._draining = True

    def sent_apart(self) -> int:
        return self.sent_bytes

    def before_ready(self, submit: SubmitControl) -> None:
        """A new registration: the broker forgot our binding, so we let go of it too."""
        if self.prefix is not None:
            self._release(self.prefix, submit)

    # --------------------------------------------------------- compute thread

    def control(self, control: str, message: WireMessage, post: Post) -> None:
        """Bind (host the store, tell the client through ``post``, form the group) or release."""
        if isinstance(message, Release):
            if message.prefix == self.prefix:
                self._close("released")
            return
        assert isinstance(message, WorkerBind), control
        self._close("rebound")
        if message.prefix in self._released:  # released before we got to it
            self._released.discard(message.prefix)
            return
        refusal = self._refusal(message)
        if refusal is not None:
            post(Status.ERROR, ErrorReply(worker=self.worker, code=ErrorCode.UNAVAILABLE.value, error=refusal))
            return
        self._bind(message, post)

    def _refusal(self, bind: WorkerBind) -> str | None:
        """Why this worker cannot bind the client of ``bind``; None if it can."""
        if self.security is not None:
            return (f"worker {self.worker} runs CURVE: an NCCL binding's rendezvous (TCPStore, gloo/NCCL "
                    f"connections) is not authenticated, so it is refused; replies go as CURVE frames")
        if bind.device_type != self.device.type:
            return (f"worker device is {self.device.type}, client device is {bind.device_type}: "
                    f"the pair group needs both on CUDA (NCCL) or both on CPU (gloo)")
        try:
            if self.advertise_host is None:
                self.advertise_host = route_address(self.broker_url)
        except OSError as e:
            return f"could not find the address to host the rendezvous store on: {e}"
        try:  # protected mode: the store and gloo listen on the advertised address
            check_exposure(self.advertise_host, f"worker {self.worker}'s NCCL rendezvous (TCPStore, gloo)",
                           authenticated=False, insecure_network=self.insecure_network)
        except ExposureError as e:
            return f"{e}; replies go as frames"
        return None

    def _bind(self, bind: WorkerBind, post: Post) -> None:
        prefix, timeout = bind.prefix, float(bind.timeout)
        assert self.advertise_host is not None  # resolved by _refusal
        try:  # only the bound client's address may reach the store (admit.py)
            store, port = PairGroup.host_store(self.advertise_host, 0, timeout,
                                               peers=client_addresses(bind.reply_to, self.advertise_host))
        except Exception as e:
            post(Status.ERROR, ErrorReply(worker=self.worker, code=ErrorCode.UNAVAILABLE.value,
                                          error=f"could not host the rendezvous store: {e}"))
            return
        rendezvous = Rendezvous(store_host=self.advertise_host, store_port=port, prefix=prefix, worker=self.worker,
                                timeout=timeout)
        post(Status.OK, BindGrant(worker=self.worker, bind=rendezvous))
        try:
            pair = PairGroup.create(self.advertise_host, port, 0, device=self.device, prefix=prefix, timeout=timeout,
                                    store=store, listen_host=self.advertise_host)
        except Exception as e:  # the client falls back to frames on its side
            event(log, logging.WARNING, "worker.nccl_bind_failed", client=bind.client[:12], error=e)
            return
        with self._lock:
            if self._closed:  # the worker stopped while the group formed
                pair.close()
                return
            self._pair, self._client, self.prefix = pair, bind.client, prefix
        event(log, logging.INFO, "worker.nccl_bound", client=bind.client[:12],
              backend="nccl" if self.device.type == "cuda" else "gloo", device=self.device)

    def takes(self, request: SupervisionRequest) -> bool:
        """A GENERATE request that asks for the pair group; ``PathUnavailable`` unless its client is bound
        to a live one."""
        if request.offer(self.name) is None or not request.is_generate:
            return False
        if self._pair is None or self._pair.closed or self.prefix in self._released:
            raise PathUnavailable(f"worker {self.worker} has no live pair group")
        if request.client != self._client:
            raise PathUnavailable(f"worker {self.worker} is not bound to this client")
        return True

    def local(self, request: SupervisionRequest) -> bool:
        """The bound client runs on this host (its offer names our host key)."""
        try:
            return NcclOffer.from_json(request.offer(self.name)).host == self.host
        except ValueError:
            return False

    def deliver(self, items: Sequence[Delivery]) -> list[Outgoing | None]:
        """Metadata over ZeroMQ; the tensors (still on our device) follow over the pair group."""
        return [Outgoing(self._header(item), [], self.name, after_post=functools.partial(
                    self._send, item.request_id, self.faults.corrupt_tensors(item.tensors)))
                for item in items]

    def _header(self, item: Delivery) -> Reply:
        descriptor = NcclDescriptor(str(self.prefix), encode_specs(item.tensors))
        return dataclasses.replace(item.reply, path={self.name: descriptor.to_json()})

    def _send(self, request_id: bytes, tensors: dict[str, torch.Tensor]) -> None:
        """After the reply's header was posted: its tensors over the pair group (returns once sent)."""
        with self._lock:
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
                event(log, logging.WARNING, "worker.nccl_send_failed", request=request_id.hex()[:12], error=e)
                self._close_locked("send failed")

    def close(self) -> None:
        """The worker stops: close the group (waiting for a transfer in progress), from any thread."""
        with self._lock:
            self._closed = True
            self._close_locked("worker stopped")

    def _close(self, reason: str) -> None:
        with self._lock:
            self._close_locked(reason)

    def _close_locked(self, reason: str) -> None:
        pair, self._pair = self._pair, None
        if pair is not None:
            pair.close()
            event(log, logging.INFO, "worker.nccl_unbound", client=str(self._client)[:12], reason=reason,
                  sent=self.sent)
        if self.prefix is not None:
            self._released.discard(self.prefix)
        self._client = self.prefix = None


def client_addresses(reply_to: str, store_host: str) -> list[str]:
    """The source addresses a bound client reaches our store from: those of its data endpoint's host (the
    address it chose to be reached at, from its route to the broker: the same route reaches us); a client
    on an ``ipc://`` endpoint is on this host and comes from ``store_host``, as we do."""
    host = urlsplit(reply_to).hostname if reply_to.startswith("tcp://") else None
    if host is None:
        return [store_host]
    try:
        return sorted({str(info[4][0]) for info in socket.getaddrinfo(host, None, address_family(store_host))})
    except OSError:
        return []
