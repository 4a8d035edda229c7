"""The client's side of NCCL: requests go to the worker bound to this client (``ClientBinding``), whose
replies are headers (``specs``) with the tensors following over the pair group; any failure sends the
request again to the shared pool as frames and drops the binding (the next call binds again)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from spec_serve.paths.base import Arrival, ClientPort, ClientSide
from spec_serve.paths.nccl.binding import ClientBinding
from spec_serve.protocol.commands import Op
from spec_serve.protocol.messages import Bound, Reply, SupervisionRequest, WireMessage
from spec_serve.transport.sockets import local_host_key


class NcclClient(ClientSide):
    name: ClassVar[str] = "nccl"
    tensors_follow: ClassVar[bool] = True

    def __init__(self, binding: ClientBinding | None, port: ClientPort):
        self.binding = binding  # None unless enable_nccl: nothing offered, a stray nccl reply falls back
        self.port = port

    def offer(self, op: str) -> dict[str, Any] | None:
        """A GENERATE request goes to our bound worker, its tensors over the pair group (binding first if
        needed: this blocks); other requests (embeddings, lm_head slices) go there too, as frames."""
        if self.binding is None:
            return None
        if op != Op.GENERATE.value:
            worker = self.binding.worker
            return {"bound": worker} if worker is not None else None
        worker = self.binding.ensure()
        return {"bound": worker, "nccl": True, "host": local_host_key()} if worker is not None else None

    def pins(self, request: SupervisionRequest) -> bool:
        return request.bound is not None

    def carries(self, reply: Reply) -> bool:
        return reply.nccl

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
        return request.unbound()

    def elsewhere(self, request: SupervisionRequest, reason: str) -> SupervisionRequest:
        if request.nccl and self.binding is not None:
            self.binding.mark_broken(reason)
        return request.unbound()

    def broken(self, reason: str, reply: Reply | None = None) -> None:
        if self.binding is not None:
            self.binding.mark_broken(reason, reply.pair if reply is not None else None)

    def on_broker(self, header: WireMessage) -> None:
        """BOUND lost: the bound worker died or registered anew (a pending BIND resolves as a refusal)."""
        if isinstance(header, Bound) and header.lost and self.binding is not None:
            self.binding.lost(header.prefix, header.error)

    def close(self) -> None:
        """RELEASE the binding (before the client's DISCONNECT) and stop the pair thread."""
        if self.binding is not None:
            self.binding.close()
