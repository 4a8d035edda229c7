"""The client's side of NCCL: requests go to the worker bound to this client (``ClientBinding``), pinned to it
(``pin``); their replies are headers (``path["nccl"]``: the tensors' specs) with the tensors following over the
pair group; any failure sends the request again to the shared pool as frames and drops the binding (the next
call binds again)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from spec_serve.paths.base import Arrival, ClientPort, ClientSide, Offer
from spec_serve.paths.nccl.binding import ClientBinding
from spec_serve.paths.nccl.messages import NcclOffer
from spec_serve.protocol.commands import Op
from spec_serve.protocol.messages import Bound, Reply, SupervisionRequest, WireMessage
from spec_serve.transport.sockets import local_host_key


class NcclClient(ClientSide):
    name: ClassVar[str] = "nccl"
    tensors_follow: ClassVar[bool] = True

    def __init__(self, binding: ClientBinding | None, port: ClientPort):
        self.binding = binding  # None unless enable_nccl: nothing offered, a stray nccl reply falls back
        self.port = port

    def offer(self, op: str) -> Offer | None:
        """A GENERATE request goes to our bound worker, its tensors over the pair group (binding first if
        needed: this blocks); other requests (embeddings, lm_head slices) go there too, as frames."""
        if self.binding is None:
            return None
        if op != Op.GENERATE.value:
            worker = self.binding.worker
            return Offer(pin=worker) if worker is not None else None
        worker = self.binding.ensure()
        return Offer(NcclOffer(host=local_host_key()).to_json(), pin=worker) if worker is not None else None

    def pins(self, request: SupervisionRequest) -> bool:
        return request.pin is not None

    def holds(self) -> str | None:
        return self.binding.worker if self.binding is not None else None

    @property
    def may_hold(self) -> bool:
        return self.binding is not None

    def hold_again(self) -> str | None:
        assert self.binding is not None  # may_hold
        return self.binding.rebind()

    def accept(self, arrival: Arrival) -> Mapping[str, Any] | None:
        """Receive the tensors on the pair thread (even for a reply nobody waits for, or the worker's send
        stalls); without a live binding, or with specs other than expected: frames instead."""
        reply = arrival.reply
        if self.binding is None or not self.binding.on_metadata(arrival.request_id, reply, arrival.expect,
                                                                arrival.max_bytes):
            reason = f"nccl reply from worker {reply.worker} without a live binding"
            self.broken(reason, reply)
            self.port.fallback(arrival.request_id, self.name, reason)
        return None

    def without(self, request: SupervisionRequest) -> SupervisionRequest:
        return request.without_offer(self.name, unpin=True)

    def elsewhere(self, request: SupervisionRequest, reason: str) -> SupervisionRequest:
        if request.offer(self.name) is not None and self.binding is not None:
            self.binding.mark_broken(reason)
        return request.without_offer(self.name, unpin=True)

    def broken(self, reason: str, reply: Reply | None = None) -> None:
        if self.binding is not None:
            descriptor = reply.descriptor(self.name) if reply is not None else None
            self.binding.mark_broken(reason, descriptor.get("pair") if isinstance(descriptor, dict) else None)

    def on_broker(self, header: WireMessage) -> None:
        """BOUND lost: the bound worker died or registered anew (a pending BIND resolves as a refusal)."""
        if isinstance(header, Bound) and header.lost and self.binding is not None:
            self.binding.lost(header.prefix, header.error)

    def close(self) -> None:
        """RELEASE the binding (before the client's DISCONNECT) and stop the pair thread."""
        if self.binding is not None:
            self.binding.close()
