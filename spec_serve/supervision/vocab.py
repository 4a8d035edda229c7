"""Draft-vocab mappings: which target token ids an EAGLE-3 draft predicts.

A mapping is ``selected_token_ids`` ``[Vd]`` int64 (draft index -> target id) and the t2d mask
``selected_token_mask`` ``[V]`` bool. Checkpoints store ``d2t[i] = selected[i] - i``. The ids are
kept sorted ascending, the EAGLE-3 convention: then ``d2t`` is non-negative and non-decreasing, and
draft index order follows target id order.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from spec_serve.supervision.contract import validate_vocab_mapping


def build_vocab_mapping(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor | None,
    vocab_size: int,
    draft_vocab_size: int,
    special_token_ids: Iterable[int] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick ``draft_vocab_size`` target ids; return ``(selected_token_ids, selected_token_mask)``.

    Priority: ``special_token_ids`` first, then ids by how often they occur where ``loss_mask`` is
    set (all of ``input_ids`` when ``None``), ties to the lower id, then unused ids ascending. The
    chosen ids are returned sorted ascending (int64 ``[Vd]``) with their bool ``[V]`` mask.
    """
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size must be in [1, {vocab_size}], got {draft_vocab_size}")
    ids = input_ids.detach().reshape(-1).to("cpu", torch.int64)
    if loss_mask is not None:
        if loss_mask.shape != input_ids.shape:
            raise ValueError(f"loss_mask shape {tuple(loss_mask.shape)} != input_ids shape {tuple(input_ids.shape)}")
        ids = ids[loss_mask.detach().reshape(-1).to("cpu").bool()]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size}), got min {int(ids.min())} max {int(ids.max())}")
    specials = list(dict.fromkeys(int(i) for i in special_token_ids))
    if any(not 0 <= i < vocab_size for i in specials):
        raise ValueError(f"special token ids must lie in [0, {vocab_size}), got {specials}")
    if len(specials) > draft_vocab_size:
        raise ValueError(f"{len(specials)} special tokens do not fit a draft vocab of {draft_vocab_size}")

    counts = torch.bincount(ids, minlength=vocab_size)
    # A stable descending sort keeps equal counts in ascending id order, so ties go to the lower id
    # and never-seen ids (count 0) come last, ascending: the padding rule for free.
    by_frequency = torch.sort(counts, descending=True, stable=True).indices
    is_special = torch.zeros(vocab_size, dtype=torch.bool)
    is_special[specials] = True
    ranked = torch.cat([torch.tensor(specials, dtype=torch.int64), by_frequency[~is_special[by_frequency]]])
    selected = ranked[:draft_vocab_size].sort().values
    return selected, mask_from_selected(selected, vocab_size)


def mask_from_selected(selected_token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bool ``[V]`` t2d mask, true at ``selected_token_ids``."""
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=selected_token_ids.device)
    mask[selected_token_ids.long()] = True
    return mask


def to_d2t(selected_token_ids: torch.Tensor) -> torch.Tensor:
    """Checkpoint form: ``d2t[i] = selected[i] - i``."""
    selected = selected_token_ids.long()
    return selected - torch.arange(selected.numel(), device=selected.device)


def from_d2t(d2t: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_d2t`: ``selected[i] = d2t[i] + i``."""
    d2t = d2t.long()
    return d2t + torch.arange(d2t.numel(), device=d2t.device)


class VocabMappingSlot:
    """The draft-vocab mapping an engine computes EAGLE-3 with: validated, copied privately (the
    caller may mutate or free its tensors afterwards), and kept on the engine's device too."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self._cpu: tuple[torch.Tensor, torch.Tensor] | None = None
        self.on_device: tuple[torch.Tensor, torch.Tensor] | None = None

    def set(self, selected_token_ids: torch.Tensor, selected_token_mask: torch.Tensor) -> None:
        validate_vocab_mapping(selected_token_ids, selected_token_mask, self.vocab_size)
        ids = selected_token_ids.detach().to("cpu", copy=True)
        mask = selected_token_mask.detach().to("cpu", copy=True)
        self._cpu = (ids, mask)
        self.on_device = (ids.to(self.device), mask.to(self.device))

    def get(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Copies of the current ``(selected_token_ids, selected_token_mask)`` on CPU, or ``None``."""
        return None if self._cpu is None else (self._cpu[0].clone(), self._cpu[1].clone())
