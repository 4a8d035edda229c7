"""Packed variable-length forwards: the real tokens of several right-padded rows as one sequence.

A padded ``[B,S]`` batch spends its forward on padding. Packing drops it: the real tokens of every
row of one or several requests are laid end to end as one ``[1,T]`` sequence (``T`` = the real
tokens), ``position_ids`` restart at 0 for each row, and attention is confined to each row (the
*document mask*: a token attends to the earlier tokens of its own row only, causal, block
diagonal). The mask is never materialised: ``row_attention`` swaps in an attention function,
registered with transformers' ``AttentionInterface``, that runs SDPA with ``is_causal=True`` once
per row, on that row's slice of the packed queries, keys and values. Everything else (projections,
MLPs, norms, lm_head) runs once over the packed tokens. So the work is that of the real tokens alone,
and each row computes exactly what it computes alone (up to kernel choice: see ``TOLERANCE``).

After the forward the per-token outputs are scattered back into each request's padded ``[B,S]``
layout (``PackedLayout.scatter``), zeros at padding, before the contract's shifts (see
docs/packing.md for what lands at padded positions).
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import cast

import torch

ATTENTION = "spec_serve_packed_rows"
# The keyword that carries the row bounds (``row_bounds``: 0 and each row's end in the packed sequence) through
# the model's forward to ``_row_attention``; transformers passes unknown keywords on to attention.
SEGMENTS_KWARG = "spec_serve_segments"


def row_lengths(attention_mask: torch.Tensor, loss_mask: torch.Tensor) -> list[int] | None:
    """Each row's real length, if the batch can be packed; else None (serve it padded).

    Packable: every row right-padded (its attention mask a run of ones, then zeros) and no loss on
    padding (a trainer's padding never carries loss; with it the padded forward's garbage at padded
    positions would reach ``position_mask``).
    """
    if attention_mask.dim() != 2 or loss_mask.shape != attention_mask.shape:
        return None  # not a valid request: the padded path reports why
    seq = attention_mask.shape[1]
    real = attention_mask.bool()
    lengths = real.sum(dim=1)
    prefix = torch.arange(seq, device=real.device)[None, :] < lengths[:, None]
    if not torch.equal(real, prefix) or bool((loss_mask.bool() & ~prefix).any()):
        return None
    return [int(n) for n in lengths.tolist()]


def row_bounds(segments: Sequence[tuple[int, int]]) -> torch.Tensor:
    """``((0, a), (a, b), ...)`` -> ``tensor([0, a, b, ...])``: consecutive rows as the packed forward takes them
    (``SEGMENTS_KWARG``), a tensor so that a compiled forward is the same graph for any number of rows."""
    if any(start != end for (_, end), (start, _) in zip(segments, segments[1:])) or not segments or segments[0][0]:
        raise ValueError(f"packed rows must be consecutive from 0, got {segments}")
    return torch.tensor([0, *(end for _, end in segments)], dtype=torch.int64)


@dataclasses.dataclass
class PackedLayout:
    """Where each request's real tokens lie in the packed sequence, and the packed inputs."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T], 0..n-1 for each row
    segments: tuple[tuple[int, int], ...]  # (start, end) of each non-empty row in [0, T)
    bounds: torch.Tensor  # [rows + 1] int64 on the host: 0, then each non-empty row's end (SEGMENTS_KWARG)
    spans: list[tuple[int, int]]  # (start, end) of each request's tokens in [0, T)
    real: list[torch.Tensor]  # each request's flat indices of real positions in its [B*S]
    shapes: list[tuple[int, int]]  # each request's [B, S]

    @classmethod
    def build(cls, requests: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> PackedLayout:
        """Pack ``(input_ids, attention_mask, loss_mask)`` requests in order; ``ValueError`` if one is
        not packable (see ``row_lengths``). Built where the inputs are, usually on the host."""
        ids: list[torch.Tensor] = []
        positions: list[torch.Tensor] = []
        segments: list[tuple[int, int]] = []
        spans: list[tuple[int, int]] = []
        real: list[torch.Tensor] = []
        shapes: list[tuple[int, int]] = []
        offset = 0
        for i, (input_ids, attention_mask, loss_mask) in enumerate(requests):
            lengths = row_lengths(attention_mask, loss_mask)
            if lengths is None:
                raise ValueError(f"request {i} cannot be packed: rows must be right-padded, with no loss on padding")
            mask = attention_mask.bool()
            ids.append(input_ids[mask].to(torch.int64))
            positions.extend(torch.arange(n) for n in lengths)
            start = offset
            for n in lengths:
                if n:
                    segments.append((offset, offset + n))
                offset += n
            spans.append((start, offset))
            real.append(mask.flatten().nonzero().squeeze(1))
            shapes.append((input_ids.shape[0], input_ids.shape[1]))  # [B, S]: the engine validated it 2-D
        if offset == 0:
            raise ValueError("nothing to pack: every row is empty")
        return cls(torch.cat(ids)[None], torch.cat(positions)[None], tuple(segments), row_bounds(segments), spans, real,
                   shapes)

    @property
    def tokens(self) -> int:
        return self.input_ids.shape[1]

    def to(self, inputs: torch.device, outputs: torch.device) -> PackedLayout:
        """The packed inputs on the model's input device, the scatter indices where its outputs land."""
        return dataclasses.replace(self, input_ids=self.input_ids.to(inputs), position_ids=self.position_ids.to(inputs),
                                   real=[r.to(outputs) for r in self.real])

    def scatter(self, packed: torch.Tensor, request: int) -> torch.Tensor:
        """Request ``request``'s slice of a packed per-token tensor ``[1,T,...]`` in its padded layout
        ``[B,S,...]``, zeros at padded positions."""
        start, end = self.spans[request]
        batch, seq = self.shapes[request]
        out = packed.new_zeros(batch * seq, *packed.shape[2:])
        out.index_copy_(0, self.real[request], packed[0, start:end])
        return out.view(batch, seq, *packed.shape[2:])


def _row_attention(module, query, key, value, attention_mask, *, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: causal SDPA within each packed row, never across rows.

    ``query`` ``[1, heads, T, D]`` (keys and values with their own head count); returns
    ``([1, T, heads, D], None)`` as every transformers attention function does. The rows run in
    ``rows_sdpa``, one op for torch.compile, so compiled decoder layers (engines.compiled) neither break
    their graph here nor depend on the number of rows.
    """
    bounds = kwargs.pop(SEGMENTS_KWARG, None)
    if bounds is None or attention_mask is not None or query.shape[0] != 1 or dropout:
        raise RuntimeError(f"attention {ATTENTION!r} runs packed forwards only (HFTarget.generate_packed)")
    groups = getattr(module, "num_key_value_groups", 1)
    return torch.ops.spec_serve.rows_sdpa(query, key, value, bounds, scaling, groups), None


# The schema is spelled out: older torch releases cannot read it from postponed (string) annotations.
@torch.library.custom_op("spec_serve::rows_sdpa", mutates_args=(), schema="(Tensor query, Tensor key, Tensor value, "
                         "Tensor bounds, float? scaling, int groups) -> Tensor")
def rows_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: torch.Tensor,
              scaling: float | None, groups: int) -> torch.Tensor:
    """Each packed row ``bounds[i]:bounds[i+1]`` through transformers' own SDPA function with no mask and
    ``is_causal=True`` (on CUDA: the flash kernel); ``[1, T, heads, D]``. ``bounds`` lives on the host."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    # All that function reads of the attention module is its number of query heads per key/value head.
    heads = cast(torch.nn.Module, types.SimpleNamespace(num_key_value_groups=groups))
    ends = bounds.tolist()
    outputs = [
        sdpa_attention_forward(heads, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], None, scaling=scaling,
                               is_causal=True)[0]
        for s, e in zip(ends[:-1], ends[1:])
    ]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)


@rows_sdpa.register_fake
def _rows_sdpa_shape(query, key, value, bounds, scaling, groups):
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])


def unsupported_reason(model) -> str | None:
    """Why ``model`` cannot run packed forwards, or None if it can.

    Packing swaps the model's attention function, so the model must dispatch attention through
    transformers' ``AttentionInterface``; and every layer must attend causally to all earlier tokens
    (a sliding window or other per-layer mask would be lost, since the packed forward passes none).
    """
    config = model.config
    if not getattr(model, "_can_set_attn_implementation", lambda: False)():
        return f"{type(model).__name__} does not dispatch attention through transformers' AttentionInterface"
    layer_types = set(getattr(config, "layer_types", None) or ())
    if layer_types - {"full_attention"}:
        return f"its layers are not all full attention ({sorted(layer_types)})"
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return f"it uses sliding-window attention (sliding_window={config.sliding_window})"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "it soft-caps attention logits"
    return None


@contextlib.contextmanager
def row_attention(model) -> Iterator[None]:
    """Within this block ``model`` attends within packed rows (pass ``SEGMENTS_KWARG`` to its forward).

    The attention implementation is a config field read at every forward, so the caller must hold
    the model for the whole block (HFTarget's forward lock does).
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _row_attention)  # idempotent
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = ATTENTION
    try:
        with any_length_attention():  # every packed row has a length of its own
            yield
    finally:
        config._attn_implementation = previous


def any_length_attention() -> contextlib.AbstractContextManager[None]:
    """SDPA without cuDNN's kernels for the block (process-wide flags, restored after). cuDNN builds an execution
    plan for each new sequence length, so batches of new lengths run slower than the same lengths seen before
    (rows of new lengths made a packed forward 0.81x the padded one, 1.80x once they repeated: BENCHMARKS.md,
    "Packed forwards"). Flash and memory-efficient kernels take any length as it comes. Packed rows and compiled
    layers run under it; where cuDNN is not available (CPU) it changes no kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


# -- how close a packed answer is to the padded forward's ----------------------------------------

@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How far a packed answer may lie from the padded forward's, per tensor, over real positions
    (``compare``). ``max_error`` = max |packed - padded| / max(1, max |padded|); ``rel_norm`` =
    ||packed - padded|| / ||padded||."""

    hidden_max_error: float  # aux/target/last hidden states
    hidden_rel_norm: float
    probs_max_error: float  # target_probs (probabilities, so max_error is absolute)
    probs_rel_norm: float
    # argmax_ids, position_mask: the fraction of compared positions that differ. Flips follow from the hidden
    # states' deviation and the logits' near-ties, so where the reference engine is at hand the bound is derived
    # per batch instead (``engines.flips.flip_bound``: the bench, the GPU compile test); this fixed one is
    # for checks without it: 0 in float32; in half precision 5%, which was set from flips measured on random
    # weights, not derived (docs/compile.md, "Why these bounds").
    flip_rate: float

    def bound(self, name: str, measure: str) -> float:
        if measure == "mismatch":
            return 0.0
        if measure == "flip_rate":
            return self.flip_rate
        return getattr(self, f"{'probs' if name == 'target_probs' else 'hidden'}_{measure}")


# By the model's dtype. float32: the kernels differ by shape only, far below these bounds (BENCHMARKS.md,
# "Packed forwards", has what was seen). bfloat16: rounds at 2^-8, and GEMM and
# attention kernels are chosen by shape, so a packed row differs as a row batched differently does;
# the bounds sit above what an H200 showed (BENCHMARKS.md, "Packed forwards"), far below what a row
# attending to another row gives (rel_norm ~1). float16 rounds finer than bfloat16: the same bounds.
_HALF = Tolerance(hidden_max_error=0.25, hidden_rel_norm=0.1, probs_max_error=0.05, probs_rel_norm=0.15,
                  flip_rate=0.05)
# float64: a packed row differs from its padded forward only by summation order. A sum of K terms in
# float64 is off by at most K * 2^-53 of the sum of their magnitudes; K stays below 2^13 in every dot
# product and reduction of a forward here (hidden size, sequence length), so 2^-40 (about 1e-12) bounds
# it with room (CPU measures 0: the same kernels). transformers computes the rotary angles in float32
# whatever the model's dtype, so a row given other positions than 0..n-1 (RoPE is relative, so a shift is
# invisible but for that rounding) is off by float32's 2^-24 (about 1e-7): 5 orders above the bound.
_FP64_BOUND = 2.0 ** -40
TOLERANCE = {
    torch.float64: Tolerance(hidden_max_error=_FP64_BOUND, hidden_rel_norm=_FP64_BOUND, probs_max_error=_FP64_BOUND,
                             probs_rel_norm=_FP64_BOUND, flip_rate=0.0),
    torch.float32: Tolerance(hidden_max_error=1e-5, hidden_rel_norm=1e-5, probs_max_error=1e-5, probs_rel_norm=1e-5,
                             flip_rate=0.0),
    torch.bfloat16: _HALF,
    torch.float16: _HALF,
}
# Tensors that hold the *next* token's target at each position: compared where the next token is real.
_NEXT_TOKEN = frozenset({"target_probs", "argmax_ids"})
_FLIPS = frozenset({"argmax_ids", "position_mask"})
_EXACT = frozenset({"input_ids", "loss_mask"})


def compare(packed: Mapping[str, torch.Tensor], padded: Mapping[str, torch.Tensor],
            attention_mask: torch.Tensor) -> dict[str, dict[str, float]]:
    """Per tensor, how far a packed answer lies from the padded forward's, over real positions.

    Real positions: those of real tokens for hidden states; those whose next token is real for
    ``target_probs`` and ``argmax_ids``; all for ``position_mask`` (False at padding in both, as
    packing requires no loss there), ``input_ids`` and ``loss_mask`` (exact: they are the inputs).
    """
    real = attention_mask.bool()
    next_real = torch.zeros_like(real)
    next_real[:, :-1] = real[:, 1:]
    report: dict[str, dict[str, float]] = {}
    for name, want in padded.items():
        got = packed.get(name)
        if got is None or got.shape != want.shape or got.dtype != want.dtype:
            report[name] = {"mismatch": 1.0}
            continue
        got = got.to(want.device)
        if name in _EXACT:
            report[name] = {"mismatch": float(not torch.equal(got, want))}
            continue
        where = (next_real if name in _NEXT_TOKEN else torch.ones_like(real) if name == "position_mask" else real)
        g, w = got[where.to(want.device)], want[where.to(want.device)]
        if name in _FLIPS:
            report[name] = {"flip_rate": float((g != w).float().mean()) if w.numel() else 0.0}
            continue
        g, w = g.float(), w.float()
        diff = (g - w).abs()
        report[name] = {
            "max_error": float(diff.max() / w.abs().max().clamp_min(1.0)) if w.numel() else 0.0,
            "rel_norm": float(diff.norm() / w.norm().clamp_min(1e-12)) if w.numel() else 0.0,
        }
    return report


def violations(report: Mapping[str, Mapping[str, float]], tolerance: Tolerance,
               flip_bounds: Mapping[str, float] | None = None) -> list[str]:
    """What in a ``compare`` report exceeds ``tolerance``, one line each; empty if all is within it.
    ``flip_bounds``: per argmax tensor, a flip bound derived for this batch (``engines.flips``), in place
    of ``tolerance.flip_rate``."""
    out = []
    for name, measures in report.items():
        for measure, value in measures.items():
            bound = tolerance.bound(name, measure)
            if measure == "flip_rate" and flip_bounds is not None and name in flip_bounds:
                bound = flip_bounds[name]
            if value > bound:
                out.append(f"{name}: {measure} {value:.3g} > {bound:.3g}")
    return out
