"""``Received``: the one thing a pending request resolves to, whoever answered it and however."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from spec_serve.protocol import wire
from spec_serve.protocol.commands import ClientCommand

# A reply tensor as received: spans over frames (or over a slot a same-host worker lent), or a device
# tensor that came over the bound worker's pair group.
ReceivedTensor = wire.TensorSpan | torch.Tensor


@dataclasses.dataclass(frozen=True)
class Received:
    """An answer to one request.

    ``broker_command`` is the broker's command (``STATUS``, ``VOCAB_OK``, a ``BOUND`` refusal) when the
    broker answered, None when a worker did (its data message: ``worker``, ``fingerprint``,
    ``digests``, ... in ``header``; an accepted ``BIND`` has ``bind`` and no tensors). ``tensors`` may be
    a ``samehost.PlaneReply``: its slot goes back to the worker through ``samehost.settle`` or
    ``samehost.release_reply``, whatever else happens to the reply.
    """

    request_id: bytes
    header: dict[str, Any]
    tensors: Mapping[str, ReceivedTensor] = dataclasses.field(default_factory=dict)
    broker_command: ClientCommand | None = None
