"""The client's side of the same-host plane: GENERATE requests offer it (``ClientPlane.offer``); a reply
lent through it is opened as spans over the worker's slot (``PlaneReply``: settled once copied out), and
one that cannot be read here is given back and asked for again without the offer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from spec_serve.paths.base import Arrival, ClientPort, ClientSide, Offer
from spec_serve.paths.plane import samehost
from spec_serve.protocol.commands import Op
from spec_serve.protocol.messages import Reply


class PlaneClient(ClientSide):
    name: ClassVar[str] = "plane"

    def __init__(self, device: torch.device, wanted: bool | None, port: ClientPort):
        # None when the plane is off here (``wanted``, else SPEC_SERVE_SAME_HOST_PLANE): nothing is offered,
        # and a lent reply (which only a misbehaving worker sends then) is asked for again without it.
        self.plane = samehost.ClientPlane.start(device, wanted)
        self.port = port

    def offer(self, op: str) -> Offer | None:
        offer = self.plane.offer() if self.plane is not None and op == Op.GENERATE.value else None
        return Offer(offer, near=offer["host"]) if offer is not None else None  # it pays on the offer's host only

    def accept(self, arrival: Arrival) -> Mapping[str, Any] | None:
        """Spans over the lent slot; None if the plane cannot deliver it here (asked for again without it)."""
        try:
            if self.plane is None:
                raise samehost.PlaneError("this client does not use the same-host plane")
            return self.plane.open(arrival.reply.descriptor(self.name), arrival.payload, arrival.request_id,
                                   arrival.again)
        except samehost.PlaneError as e:
            self.discard(arrival.reply)
            if self.plane is not None:
                self.plane.failed(e)
            self.port.fallback(arrival.request_id, self.name, str(e))
            return None

    def discard(self, reply: Reply) -> None:
        """The slot goes back unread."""
        descriptor = reply.descriptor(self.name)
        if descriptor is not None and self.plane is not None:
            self.plane.release(descriptor)

    def lent_bytes(self, reply: Reply) -> int:
        return samehost.lent_bytes(reply.descriptor(self.name))

    def tick(self) -> None:
        if self.plane is not None:
            self.plane.tick()

    def stop(self) -> None:
        if self.plane is not None:
            self.plane.close()
