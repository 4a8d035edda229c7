"""The client's side of frames: a reply's payload frames checked (``wire.parse``: header, sizes, bool bytes)
and left where they arrived as spans; the client copies them straight to where the caller wants them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from spec_serve.paths.base import Arrival, ClientSide
from spec_serve.protocol import wire
from spec_serve.protocol.messages import Reply


class FramesClient(ClientSide):
    name: ClassVar[str] = "frames"

    def carries(self, reply: Reply) -> bool:
        return True  # whatever no other path claims came as frames

    def accept(self, arrival: Arrival) -> Mapping[str, Any]:
        return wire.parse(arrival.payload, max_bytes=arrival.max_bytes)[0]
