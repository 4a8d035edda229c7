"""Compact EAGLE-3: rebuild ``target_probs`` and ``position_mask`` on the client.

A compact batch (kind "eagle3_compact") carries the final-norm hidden state ``[B,S,H]`` and the
shifted full-vocab argmax ``[B,S]`` instead of ``target_probs`` ``[B,S,Vd]`` float32: about 32 KiB a
token instead of 152 KiB at H=4096, Vd=32k. The client keeps the draft-vocab rows of the lm_head
and recomputes the draft logits itself. Those equal the engine's only up to matmul rounding (a
``[Vd,H]`` GEMM need not reduce exactly like the engine's ``[V,H]`` one); the argmax, and so
``position_mask``, is the target's own and exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spec_serve.supervision.contract import RESPONSE_TENSORS, Kind


def shift_left(t: torch.Tensor) -> torch.Tensor:
    """``t`` shifted left by one along dim 1, the last position zero (EAGLE-3's target alignment)."""
    out = torch.zeros_like(t)
    out[:, :-1] = t[:, 1:]
    return out


def eagle3_targets(
    next_draft_logits: torch.Tensor,
    argmax_ids: torch.Tensor,
    selected_token_mask: torch.Tensor,
    shifted_loss_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3's ``(target_probs [B,S,Vd] float32, position_mask [B,S,1] bool)``.

    ``next_draft_logits`` ``[B,S-1,Vd]``: row ``t`` holds the draft-vocab logits of position ``t+1``.
    ``argmax_ids`` ``[B,S]`` and ``shifted_loss_mask`` ``[B,S]`` are already shifted left by one.
    The last position has no next token: its logits are a zero row, so its probs are the float32
    softmax of zeros, uniform ``1/Vd`` (bit for bit what NeMo AutoModel's server returns), and its
    mask is false.
    """
    batch, seq = argmax_ids.shape
    # The logits padded with a zero row, in float32, written in one buffer (no padded copy in the logits'
    # dtype): the same values, so the same softmax, bit for bit, as softmax(cat([logits, zeros]).float()).
    padded = torch.empty(batch, seq, next_draft_logits.shape[-1], dtype=torch.float32, device=next_draft_logits.device)
    padded[:, :-1].copy_(next_draft_logits)
    padded[:, -1].zero_()
    target_probs = torch.softmax(padded, dim=-1)
    position_mask = selected_token_mask[argmax_ids.long()] & shifted_loss_mask.bool()
    position_mask[:, -1] = False
    return target_probs, position_mask.unsqueeze(-1)


def lm_head_slice(output_embedding_weight: torch.Tensor, selected_token_ids: torch.Tensor) -> torch.Tensor:
    """The draft-vocab rows ``[Vd, H]`` of the target's lm_head weight ``[V, H]``: what the client caches."""
    rows = selected_token_ids.to(output_embedding_weight.device)
    return output_embedding_weight.detach().index_select(0, rows).contiguous()


# The alignment of a fresh tensor (torch's CPU allocator aligns to 64 bytes; CUDA's to more).
ALIGNMENT = 64


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a fresh copy of it where its memory is not ``ALIGNMENT``-aligned (a view of a received
    frame): MKL's fp32 GEMM of a few rows gives other low bits for an operand 8 bytes off (measured), and
    the colocated expansion runs on fresh tensors."""
    return t if t.data_ptr() % ALIGNMENT == 0 else t.clone(memory_format=torch.contiguous_format)


# no_grad, not inference_mode: the results feed the trainer, and inference tensors cannot be
# saved for backward.
@torch.no_grad()
def expand_compact(
    batch: dict[str, torch.Tensor], lm_head_slice: torch.Tensor, selected_token_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Turn a compact EAGLE-3 batch into exactly the EAGLE-3 contract tensors, on the batch's device.

    ``lm_head_slice`` ``[Vd, H]`` (see :func:`lm_head_slice`) and ``selected_token_mask`` ``[V]`` must
    come from the same draft-vocab mapping. The draft logits use ``F.linear`` in the hidden-state
    dtype, the same op as the target's lm_head.
    """
    missing = [name for name in RESPONSE_TENSORS[Kind.EAGLE3_COMPACT] if name not in batch]
    if missing:
        raise ValueError(f"not a compact EAGLE-3 batch: lacks {missing}")
    last = _aligned(batch["last_hidden_states"])
    device = last.device
    weight = _aligned(lm_head_slice.to(device, last.dtype))
    next_draft_logits = F.linear(last[:, 1:], weight)
    target_probs, position_mask = eagle3_targets(
        next_draft_logits, batch["argmax_ids"].to(device), selected_token_mask.to(device), batch["loss_mask"].to(device)
    )
    return {
        "aux_hidden_states": batch["aux_hidden_states"],
        "target_probs": target_probs,
        "position_mask": position_mask,
        "input_ids": batch["input_ids"],
        "loss_mask": batch["loss_mask"],
    }
