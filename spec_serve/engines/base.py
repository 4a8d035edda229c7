"""What an engine is: the surface a worker serves and a trainer calls, as a ``typing.Protocol``.

An engine runs one frozen target and answers the supervision contract
(:mod:`spec_serve.supervision.contract`). The colocated engines (``HFTarget``, ``VLLMTarget``,
``SGLangTarget``) and the client's ``RemoteTargetModel`` all have this surface, so the worker serves
any engine, and a trainer swaps a colocated target for a remote one, without knowing which it holds.
tests/worker/test_engine_protocol.py checks every engine class against it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from spec_serve.supervision.contract import Kind
from spec_serve.supervision.target_info import TargetInfo


class HasWeight(Protocol):
    """An embedding or lm_head as engines hand it out: an object with ``.weight`` ``[V, H]``."""

    weight: torch.Tensor


@runtime_checkable
class TargetEngine(Protocol):
    """A frozen target serving the contract. Outputs are on the engine's device."""

    def target_info(self) -> TargetInfo:
        """What this engine serves, as checked by clients at setup."""
        ...

    def set_vocab_mapping(self, selected_token_ids: torch.Tensor, selected_token_mask: torch.Tensor) -> None:
        """Install the draft-vocab mapping EAGLE-3 batches are computed with (``ValueError`` if invalid)."""
        ...

    def generate_batch(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        loss_mask: torch.Tensor,
        kind: str | Kind = "eagle3",
    ) -> dict[str, torch.Tensor]:
        """The contract tensors of ``kind`` for one right-padded ``[B,S]`` batch, in ``RESPONSE_TENSORS`` order.

        ``ValueError`` for an invalid request, ``RuntimeError`` for EAGLE-3 before ``set_vocab_mapping``.
        """
        ...

    def get_input_embeddings(self) -> HasWeight:
        """The input embedding (``.weight`` ``[V, H]``)."""
        ...

    def get_output_embeddings(self) -> HasWeight:
        """The lm_head (``.weight`` ``[V, H]``); for tied models, the input embedding's weight."""
        ...

    def close(self) -> None:
        """Release what the engine holds (engine processes, files, sockets); idempotent."""
        ...


@runtime_checkable
class PackingEngine(TargetEngine, Protocol):
    """An engine that can also run several requests as one packed forward (``--packing``)."""

    def generate_packed(
        self,
        requests: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        kind: str | Kind = "eagle3",
    ) -> list[dict[str, torch.Tensor]]:
        """``generate_batch`` of each ``(input_ids, attention_mask, loss_mask)`` request, in one forward."""
        ...

    def packing_unsupported(self) -> str | None:
        """Why this engine's model cannot run ``generate_packed``, or None if it can."""
        ...
