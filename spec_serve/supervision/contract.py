"""The supervision contract: tensor names, kinds, layer-id rules and target info.

Every engine (hf, vllm, sglang) emits exactly these tensors, so the client and
the trainer never need to know which engine answered. See DESIGN.md.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence

import torch

from spec_serve.supervision import fp8
from spec_serve.supervision.target_info import TargetInfo
from spec_serve.supervision.vocab_rule import IDS_RULE, MASK_RULE, validate_mapping


class Kind(str, enum.Enum):
    """What a request asks for; the value is the wire spelling."""

    EAGLE3 = "eagle3"
    # Compact EAGLE-3: aux + final hidden state + full-vocab argmax; the client
    # rebuilds target_probs/position_mask from a cached draft-vocab lm_head slice.
    EAGLE3_COMPACT = "eagle3_compact"
    DSPARK = "dspark"

    @classmethod
    def parse(cls, value: str | Kind) -> Kind:
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(k.value for k in cls)
            raise ValueError(f"unknown kind {value!r}; expected one of: {names}") from None


# Request tensors, each [B, S], right-padded.
REQUEST_TENSORS = ("input_ids", "attention_mask", "loss_mask")

# Response tensor names per kind, in the order engines emit them.
RESPONSE_TENSORS: dict[Kind, tuple[str, ...]] = {
    Kind.EAGLE3: ("aux_hidden_states", "target_probs", "position_mask", "input_ids", "loss_mask"),
    Kind.EAGLE3_COMPACT: ("aux_hidden_states", "last_hidden_states", "argmax_ids", "input_ids", "loss_mask"),
    Kind.DSPARK: ("target_hidden_states", "target_last_hidden_states", "input_ids", "loss_mask"),
}

# What a wire_dtype="fp8" reply quantizes (supervision/fp8.py): the hidden states a draft takes as its input.
# Argmax ids and target_probs are computed by the worker from the unquantized states and travel as they are, and
# compact's last_hidden_states, from which a client computes target_probs, travels in the model dtype: so the
# probabilities come exact in every kind (an FP8 final state moved them 3.5% and their argmax at 6% of positions
# at the 8B shape: docs/equality.md).
FP8_TENSORS = ("aux_hidden_states", "target_hidden_states", "target_last_hidden_states")

INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3 default capture layers: ``[1, N//2 - 1, N - 4]``."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def default_dspark_layer_ids(num_layers: int, k: int | None = None) -> list[int]:
    """DSpark default: ``k`` ids spread evenly, ``round(1 + i*(N-2)/(k-1))``.

    ``k`` defaults to 5, or ``N - 1`` for targets too shallow for 5 distinct ids.
    """
    if k is None:
        k = min(5, num_layers - 1)
    if k < 2 or num_layers < 3:
        raise ValueError(f"DSpark needs k >= 2 layers of a target with >= 3 layers, got k={k}, N={num_layers}")
    return validate_dspark_layer_ids([int(round(1 + i * (num_layers - 2) / (k - 1))) for i in range(k)], num_layers)


def validate_aux_layer_ids(ids: Sequence[int], num_layers: int) -> list[int]:
    """Check EAGLE-3 aux layer ids: exactly 3, distinct, each in ``[0, N)``."""
    ids = [int(i) for i in ids]
    if len(ids) != 3:
        raise ValueError(f"EAGLE-3 needs exactly 3 aux layer ids, got {len(ids)}: {ids}")
    if len(set(ids)) != 3:
        raise ValueError(f"EAGLE-3 aux layer ids must be distinct, got {ids}")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"aux layer ids {bad} out of range [0, {num_layers}) for a {num_layers}-layer target")
    return ids


def validate_dspark_layer_ids(ids: Sequence[int], num_layers: int) -> list[int]:
    """Check DSpark layer ids: strictly increasing, each in ``[-1, N)`` (-1 = embeddings)."""
    ids = [int(i) for i in ids]
    if not ids:
        raise ValueError("DSpark needs at least one target layer id")
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise ValueError(f"DSpark layer ids must be strictly increasing, got {ids}")
    bad = [i for i in ids if not -1 <= i < num_layers]
    if bad:
        raise ValueError(f"DSpark layer ids {bad} out of range [-1, {num_layers}) for a {num_layers}-layer target")
    return ids


def validate_request(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    vocab_size: int,
) -> None:
    """Raise ``ValueError`` unless the three request tensors form a valid batch."""
    tensors = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be [batch, seq], got shape {tuple(t.shape)}")
        if t.dtype not in INTEGER_DTYPES:
            raise ValueError(f"{name} must be an integer or bool tensor, got {t.dtype}")
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"request tensors must share one [batch, seq] shape, got {shapes}")
    if input_ids.numel() == 0:
        raise ValueError(f"empty request: shape {tuple(input_ids.shape)}")
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"token ids must lie in [0, {vocab_size}), got min {lo} max {hi}")


def right_padded_rows(attention_mask: torch.Tensor) -> torch.Tensor:
    """Per row of a ``[B, S]`` mask, whether it is ones, then zeros (real tokens, then padding)."""
    real = attention_mask.bool()
    return (real[:, 1:] <= real[:, :-1]).all(dim=1)


def right_padded(attention_mask: torch.Tensor) -> bool:
    """Whether every row of the mask is right-padded (``right_padded_rows``)."""
    return bool(right_padded_rows(attention_mask).all())


def validate_vocab_mapping(
    selected_token_ids: torch.Tensor, selected_token_mask: torch.Tensor, vocab_size: int | None = None
) -> None:
    """Raise ``ValueError`` unless (ids, mask) is a consistent draft-vocab mapping (``vocab_rule.py``).

    ``selected_token_ids``: int64 ``[Vd]``, distinct target ids in ``[0, V)``;
    ``selected_token_mask``: bool ``[V]``, True exactly at those ids.
    """
    ids, mask = selected_token_ids, selected_token_mask
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64:
        raise ValueError(IDS_RULE)
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise ValueError(MASK_RULE)
    validate_mapping(ids.detach().cpu().numpy(), mask.detach().cpu().numpy(), vocab_size)


# name -> (dtype, shape): what a reply must hold.
ReplySpecs = dict[str, tuple[torch.dtype, tuple[int, ...]]]


def model_dtype(info: TargetInfo) -> torch.dtype:
    """The dtype of the target's hidden states and weights, from ``info.dtype`` (e.g. "bfloat16")."""
    dtype = getattr(torch, info.dtype, None) if isinstance(info.dtype, str) else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"target info dtype {info.dtype!r} is not a torch floating-point dtype")
    return dtype


def reply_specs(kind: Kind, info: TargetInfo, rows: int, seq: int, loss_mask_dtype: torch.dtype,
                draft_vocab: int | None) -> ReplySpecs:
    """Names, dtypes and shapes of the reply to a ``[rows, seq]`` request of ``kind`` (DESIGN.md)."""
    dtype, hidden, tokens = model_dtype(info), info.hidden_size, (rows, seq)
    common = {"input_ids": (torch.int64, tokens), "loss_mask": (loss_mask_dtype, tokens)}
    if kind is Kind.DSPARK:
        return {"target_hidden_states": (dtype, (rows, seq, len(info.dspark_layer_ids) * hidden)),
                "target_last_hidden_states": (dtype, (rows, seq, hidden)), **common}
    aux = {"aux_hidden_states": (dtype, (rows, seq, len(info.aux_layer_ids) * hidden))}
    if kind is Kind.EAGLE3_COMPACT:
        return {**aux, "last_hidden_states": (dtype, (rows, seq, hidden)), "argmax_ids": (torch.int32, tokens),
                **common}
    if draft_vocab is None:
        raise ValueError("EAGLE-3 replies need the draft vocab size")
    return {**aux, "target_probs": (torch.float32, (rows, seq, draft_vocab)),
            "position_mask": (torch.bool, (rows, seq, 1)), **common}


def fp8_specs(specs: ReplySpecs, hidden_size: int) -> ReplySpecs:
    """``specs`` as a wire_dtype="fp8" reply holds them: each hidden state float8_e4m3fn, followed by its
    float32 ``NAME_scale`` (one a token and ``hidden_size`` block: ``fp8.quantize_reply``)."""
    out: ReplySpecs = {}
    for name, (dtype, shape) in specs.items():
        if name in FP8_TENSORS:
            out[name] = (fp8.FP8_DTYPE, shape)
            out[name + fp8.SCALE_SUFFIX] = (torch.float32, (*shape[:-1], shape[-1] // hidden_size))
        else:
            out[name] = (dtype, shape)
    return out


def weight_specs(info: TargetInfo, rows: int) -> ReplySpecs:
    """An embeddings (``rows`` = V) or lm_head slice (``rows`` = Vd) reply: ``weight`` ``[rows, H]``."""
    return {"weight": (model_dtype(info), (rows, info.hidden_size))}


def reply_bytes(specs: ReplySpecs) -> int:
    return sum(math.prod(shape) * dtype.itemsize for dtype, shape in specs.values())


@dataclasses.dataclass(frozen=True)
class Expected:
    """What a reply may hold: ``specs``, the kind asked; with ``compact`` (an EAGLE-3 request the worker may
    answer in either format, compact="auto") the compact EAGLE-3 tensors instead, when the reply says so.
    With ``fp8_block`` (the hidden size of a request asking wire_dtype="fp8") either in their fp8 form
    (``fp8_specs``), when the reply says so: a worker that cannot send FP8 answers in the model dtype."""

    specs: ReplySpecs
    compact: ReplySpecs | None = None
    fp8_block: int | None = None

    def for_reply(self, kind: str | None, wire_dtype: str | None = None) -> ReplySpecs:
        """The specs of a reply whose header names ``kind`` (None: the kind asked) and ``wire_dtype`` (None:
        the model dtype; an fp8 reply to a request that did not ask fp8 matches nothing)."""
        specs = self.compact if kind == Kind.EAGLE3_COMPACT.value and self.compact is not None else self.specs
        if wire_dtype is None:
            return specs
        if self.fp8_block is None:
            return {}
        return fp8_specs(specs, self.fp8_block)

    @property
    def nbytes(self) -> int:
        """The most bytes such a reply holds."""
        return max(reply_bytes(self.specs), reply_bytes(self.compact) if self.compact is not None else 0)


def validate_reply(got: Mapping[str, tuple[torch.dtype, Sequence[int]]], expected: ReplySpecs) -> None:
    """Raise ``ValueError`` naming each tensor missing, extra, or of another dtype or shape than ``expected``.

    Called on a reply's parsed header, before anything is allocated for it.
    """
    problems = [f"missing {name!r}" for name in expected if name not in got]
    problems += [f"unexpected {name!r}" for name in got if name not in expected]
    for name, (dtype, shape) in got.items():
        if name in expected and (dtype, tuple(shape)) != expected[name]:
            want_dtype, want_shape = expected[name]
            problems.append(f"{name!r} is {dtype}{list(shape)}, expected {want_dtype}{list(want_shape)}")
    if problems:
        raise ValueError("reply breaks the contract: " + "; ".join(problems))
