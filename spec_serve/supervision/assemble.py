"""The one assembly of the contract tensors from a forward's states, for every engine.

(Not the client's assembly of reply shards into a batch: that lives with the client.)

An engine runs its target however it runs it and hands over the final-norm output ``last`` and the
states of the contract's layer ids. Two steps turn them into a reply, and every engine (HFTarget,
padded and packed, and the captured engines vllm and sglang) calls both, so their replies come
from the same ops in the same order:

1. :func:`per_token` reduces the states of each token: concatenates the kind's layers, and for
   EAGLE-3 runs lm_head once and keeps only the full-vocab argmax and the draft-vocab slice of the
   logits (the one place the logits are sliced), so the full-vocab buffer never outlives the call.
2. :func:`contract_tensors` applies EAGLE-3's shift-left alignment (``eagle3_targets``) to those
   per-token outputs laid out as the request's padded ``[B,S]``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from spec_serve.supervision.contract import Kind
from spec_serve.supervision.eagle3 import eagle3_targets, shift_left

# The draft-vocab mapping on the engine's device, (selected_token_ids [Vd], selected_token_mask [V]);
# None until one is set (then only EAGLE-3 refuses).
DeviceMapping = tuple[torch.Tensor, torch.Tensor] | None


def layer_ids(kind: Kind, aux_layer_ids: Sequence[int], dspark_layer_ids: Sequence[int]) -> Sequence[int]:
    """The contract layer ids whose states a request of ``kind`` needs: DSpark's, or EAGLE-3's aux ids."""
    return dspark_layer_ids if kind is Kind.DSPARK else aux_layer_ids


def per_token(
    kind: Kind,
    last: torch.Tensor,
    layers: Mapping[int, torch.Tensor],
    ids: Sequence[int],
    lm_head: Callable[[torch.Tensor], torch.Tensor],
    mapping: DeviceMapping,
) -> dict[str, torch.Tensor]:
    """A forward's outputs for each token, before the contract shifts anything.

    ``last``: the final-norm output ``[..., H]``; ``layers``: each of ``ids`` (see :func:`layer_ids`)
    -> HF ``hidden_states[id+1]`` (id N-1 is ``last`` itself); ``lm_head``: the target's own lm_head
    op, applied to ``last`` in the model dtype (at a large vocab, float32 logits would double the
    largest buffer). Zero states at a position give zero outputs there: argmax 0, uniform draft
    probabilities.
    """
    states = torch.cat([layers[i] for i in ids], dim=-1)
    if kind is Kind.DSPARK:
        return {"target_hidden_states": states, "target_last_hidden_states": last}
    out = {"aux_hidden_states": states}
    logits = lm_head(last)
    out["argmax"] = logits.argmax(dim=-1)
    if kind is Kind.EAGLE3_COMPACT:
        out["last_hidden_states"] = last
    else:
        # A full EAGLE-3 request has a mapping: engines refuse one before set_vocab_mapping.
        out["draft_logits"] = logits.index_select(-1, mapping[0])  # type: ignore[index]
    return out


def next_token_real(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B,S]`` bool: position ``t`` has a real next token (``attention_mask[:, t+1]`` set)."""
    return shift_left(attention_mask != 0)


def contract_tensors(
    kind: Kind,
    per_token: Mapping[str, torch.Tensor],
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    mapping: DeviceMapping,
    next_real: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The contract tensors of one padded ``[B,S]`` request, in ``RESPONSE_TENSORS`` order, from its
    :func:`per_token` outputs laid out as ``[B,S,...]``.

    ``mapping`` is read once per request by the engine, so that a concurrent ``set_vocab_mapping``
    cannot mix two mappings into one answer. ``next_real`` (:func:`next_token_real`), given by
    engines whose states are zero past a row's end, makes every position without a real next token
    answer as padding: argmax 0, ``position_mask`` false, ``target_probs`` zero, except at ``S-1``,
    which keeps ``eagle3_targets``' softmax of zeros (``1/Vd``) in every engine. HFTarget passes
    none: its padded forward's values there are what the forward computed, bit-equal to HF's own.
    """
    if kind is Kind.DSPARK:
        return {**per_token, "input_ids": input_ids, "loss_mask": loss_mask}
    argmax = shift_left(per_token["argmax"])
    if next_real is not None:
        argmax = argmax * next_real
    shifted_ids, shifted_loss = shift_left(input_ids), shift_left(loss_mask)
    if kind is Kind.EAGLE3_COMPACT:
        return {
            "aux_hidden_states": per_token["aux_hidden_states"],
            "last_hidden_states": per_token["last_hidden_states"],
            "argmax_ids": argmax.to(torch.int32),
            "input_ids": shifted_ids,
            "loss_mask": shifted_loss,
        }
    selected_mask = mapping[1]  # type: ignore[index]  # set for full EAGLE-3, as in per_token
    target_probs, position_mask = eagle3_targets(per_token["draft_logits"][:, 1:], argmax, selected_mask, shifted_loss)
    if next_real is not None:
        kept = next_real.clone()
        kept[:, -1] = True  # no next token anywhere: eagle3_targets' softmax of zeros, kept as is
        target_probs *= kept.unsqueeze(-1)
        position_mask &= next_real.unsqueeze(-1)
    return {
        "aux_hidden_states": per_token["aux_hidden_states"],
        "target_probs": target_probs,
        "position_mask": position_mask,
        "input_ids": shifted_ids,
        "loss_mask": shifted_loss,
    }
