"""NeMo's packed rows as spec-serve requests, and the replies laid back out as NeMo's packed rows.

With ``packed_sequence_size: P > 0`` NeMo's EAGLE-3 data lays several documents end to end in one row
of width ``P``: ``seq_lens`` ``[B, max_docs]`` holds each document's length (0-padded; the row's trailing
padding counts as part of its last document, so every row sums to ``P``), ``position_ids`` restart at 0
for each document, and ``doc_remaining`` counts the real tokens after each slot within its document.
NeMo's colocated target runs the row with a block-causal mask: each token attends to the earlier tokens
of its own document only (the trailing padding too, as the last document's continuation).

That is exactly what spec-serve's packing worker (``--packing``, docs/packing.md) computes for a request
whose rows are those documents: it lays the rows end to end with positions restarting per row and
attends within each row. So :class:`Documents` turns a packed batch into one request with a row per
document (right-padded to the longest), and lays each reply back out in NeMo's packed frame:

- ``aux_hidden_states``: each document's states at its own slots;
- ``input_ids``, ``loss_mask``: NeMo's packed row shifted left by one, as NeMo's target shifts it;
- ``target_probs``, ``position_mask``: within a document, the reply's (the next token's distribution);
  at the last slot of a document, the softmax of zeros (``1/Vd``) and False. NeMo's colocated forward
  puts the *next document's* first prediction there instead, which its trainer never reads: it
  supervises slot ``t`` at step ``k`` only while ``k < doc_remaining[t]``, and ``doc_remaining`` is 0 at
  a document's last slot (docs/migrating-from-nemo.md).

A worker without ``--packing`` serves the same request padded: each document causally on its own, so
the same values at a higher cost. Either way the results lie within ``engines.packing.TOLERANCE`` of
NeMo's colocated packed forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from spec_serve.supervision.eagle3 import shift_left

# What NeMo's recipe passes a target along with a packed batch (and nothing else).
PACKING_KEYS = ("position_ids", "seq_lens", "doc_remaining")


@dataclasses.dataclass(frozen=True)
class Documents:
    """The documents of a packed ``[B, P]`` batch as request rows ``[D, L]`` (``L``: the longest document)."""

    input_ids: torch.Tensor  # [D, L]: each document's tokens, then zeros
    attention_mask: torch.Tensor  # [D, L]: ones over each document (its padding included, as NeMo computes it)
    loss_mask: torch.Tensor  # [D, L]: NeMo's loss mask over each document
    index: torch.Tensor  # [B*P]: each packed slot's flat position in a [D*L] reply
    last: torch.Tensor  # [B, P] bool: the last slot of each document
    packed_ids: torch.Tensor  # [B, P]: NeMo's rows, for the shifts
    packed_loss: torch.Tensor  # [B, P]

    @classmethod
    def split(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
              seq_lens: torch.Tensor, position_ids: torch.Tensor | None = None) -> Documents:
        """The request rows of a packed batch; ``ValueError`` naming what does not hold NeMo's layout."""
        ids, loss = input_ids.to("cpu"), loss_mask.to("cpu")
        batch, width = ids.shape
        lengths = _document_lengths(seq_lens.to("cpu", torch.int64), batch, width)
        longest = int(lengths.max())
        doc_of_slot = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)  # [B*P], row-major
        starts = torch.cumsum(lengths, 0) - lengths
        in_doc = torch.arange(batch * width) - starts[doc_of_slot]  # each slot's position in its document
        if position_ids is not None and not torch.equal(position_ids.to("cpu", torch.int64).reshape(-1), in_doc):
            raise ValueError("position_ids must count 0, 1, ... within each document of seq_lens (NeMo's packed "
                             "rows); spec-serve's workers number positions that way")
        index = doc_of_slot * longest + in_doc
        shape = (lengths.numel(), longest)
        request_ids = ids.new_zeros(shape)
        request_ids.view(-1)[index] = ids.reshape(-1)
        request_attention = attention_mask.new_zeros(shape, device="cpu")
        request_attention.view(-1)[index] = 1
        request_loss = loss.new_zeros(shape)
        request_loss.view(-1)[index] = loss.reshape(-1)
        last = (in_doc == lengths[doc_of_slot] - 1).view(batch, width)
        return cls(request_ids, request_attention, request_loss, index, last, ids, loss)

    @property
    def count(self) -> int:
        return self.input_ids.shape[0]

    def gather(self, reply: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
        """An EAGLE-3 reply to :meth:`split`'s request, laid out as NeMo's packed ``[B, P, ...]`` batch."""
        batch, width = self.last.shape
        index, last = self.index.to(device), self.last.to(device)

        def packed(name: str) -> torch.Tensor:
            tensor = reply[name]
            flat = tensor.reshape(-1, *tensor.shape[2:]).index_select(0, index)
            return flat.view(batch, width, *tensor.shape[2:])

        target_probs = packed("target_probs")
        draft_vocab = target_probs.shape[-1]
        # NeMo's softmax of a zero logits row, over the draft vocab: what it has where no next token is.
        target_probs[last] = torch.softmax(torch.zeros(draft_vocab, device=device), dim=-1)
        position_mask = packed("position_mask")
        position_mask[last] = False
        return {
            "aux_hidden_states": packed("aux_hidden_states"),
            "target_probs": target_probs,
            "position_mask": position_mask,
            "input_ids": shift_left(self.packed_ids).to(device),
            "loss_mask": shift_left(self.packed_loss).to(device),
        }


def _document_lengths(seq_lens: torch.Tensor, batch: int, width: int) -> torch.Tensor:
    """The documents' lengths in row-major order, checked against NeMo's layout (rows of ``width``)."""
    if seq_lens.dim() != 2 or seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens must be [batch={batch}, max_docs] (NeMo's packed batches), got "
                         f"{tuple(seq_lens.shape)}")
    sums = seq_lens.sum(dim=1)
    if bool((seq_lens < 0).any()) or not bool((sums == width).all()):
        raise ValueError(f"each row of seq_lens must be non-negative and sum to the packed width {width} (trailing "
                         f"padding folded into the last document, as NeMo packs), got row sums {sums.tolist()}")
    return seq_lens[seq_lens > 0]
