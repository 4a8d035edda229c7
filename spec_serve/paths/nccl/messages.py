"""NCCL's own fields, carried opaquely by the shared messages: its offer (a REQUEST's ``offers["nccl"]``) and
its descriptor (a DATA header's ``path["nccl"]``), typed and checked here like the protocol's messages.
The request also names the bound worker as its ``pin``: that, and not this offer, is what the broker routes by."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from spec_serve.protocol.messages import HeaderReader, WireMessage


@dataclasses.dataclass(frozen=True)
class NcclOffer(WireMessage):
    """``offers["nccl"]``: send this GENERATE reply's tensors over our pair group; ``host``: the client's host
    key (a reply that stays on its host is answered full under ``compact="auto"``)."""

    COMMAND: ClassVar[str] = "REQUEST offers.nccl"

    host: str | None = None

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> NcclOffer:
        return cls(host=HeaderReader(cls.COMMAND, raw).text("host"))


@dataclasses.dataclass(frozen=True)
class NcclDescriptor(WireMessage):
    """``path["nccl"]``: the reply's tensors follow over the pair group ``pair`` (its binding's prefix), as
    ``specs`` lists them (``[name, shape, dtype]`` each: binding.decode_specs checks them)."""

    COMMAND: ClassVar[str] = "DATA path.nccl"

    pair: str = ""
    specs: list[Any] = dataclasses.field(default_factory=list)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> NcclDescriptor:
        r = HeaderReader(cls.COMMAND, raw)
        return cls(pair=r.required_text("pair"), specs=r.array("specs") or [])
