"""``Received``: the one thing a pending request resolves to, whoever answered it and however."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Protocol

import torch

from spec_serve.protocol.commands import ClientCommand
from spec_serve.protocol.messages import WireMessage


class Span(Protocol):
    """A reply tensor's bytes where they arrived, not yet copied: over frames (``wire.TensorSpan``) or
    over memory a worker lent (a ``paths.base.LentReply``'s spans)."""

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def nbytes(self) -> int: ...

    def view(self) -> torch.Tensor | None: ...

    def copy_into(self, out: torch.Tensor) -> torch.Tensor: ...


# A reply tensor as received: a span, or a device tensor that its path received (tensors that follow).
ReceivedTensor = Span | torch.Tensor


@dataclasses.dataclass(frozen=True)
class Received:
    """An answer to one request.

    ``header`` is the answer's typed header: the broker's (``StatusPage``, ``VocabOk``, a ``Bound``
    refusal; ``broker_command`` says which command) or a worker's data message (``Reply``; an accepted
    ``BIND``: ``BindGrant``, no tensors; ``broker_command`` None). ``tensors`` may be
    a ``paths.base.LentReply`` (memory a worker lent): its memory goes back to the worker through
    ``paths.base.settle`` or ``paths.base.release``, whatever else happens to the reply.
    """

    request_id: bytes
    header: WireMessage
    tensors: Mapping[str, ReceivedTensor] = dataclasses.field(default_factory=dict)
    broker_command: ClientCommand | None = None
