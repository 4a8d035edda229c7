"""How far the contract lets a batch computed in another batch composition differ from the reference.

The contract (docs/equality.md):

1. Each shard a worker returns is bit-equal (``torch.equal``) to the colocated forward of the same rows
   in the same batch composition: the same rows, padded to the same length, on the same engine and
   device.
2. The assembled batch (shards gathered, or rows re-batched) equals the unsharded forward bit for bit
   where the kernels are batch-invariant for the two compositions, and lies within
   :class:`CompositionTolerance` of it elsewhere.

Why (2) can differ: a kernel may reduce a row's dot products in another order when the rows around it
change. MKL's fp32 GEMM on AVX-512 CPUs takes another path for a few rows (M < 8 here; at 64-token rows
on another Xeon); cuBLAS picks kernels by shape. Each order rounds correctly; the low bits differ.

The derivation. ``u`` is a dtype's unit roundoff (2^-24 float32, 2^-11 float16, 2^-8 bfloat16); CPU and
GPU kernels accumulate all three in float32, so ``u_acc`` = 2^-24.

- One reduction of length ``K`` summed in another order: the two sums differ by about
  ``sqrt(K) * u_acc`` relative to the sum of the terms' magnitudes (the K roundings behave like a
  random walk; Higham and Mary, 2019, show ``sqrt(K) * u`` holds with high probability where the
  worst case is ``K * u``). The sum is then stored in the model dtype, where two different sums may
  round one unit apart: ``2 * u_out``. So one stage adds ``e = 2 * u_out + sqrt(K) * u_acc``, with ``K``
  the longest reduction of the model (its MLP's intermediate size).
- A Llama-style decoder layer runs ``REDUCTIONS_PER_LAYER`` = 8 reductions in series on the residual
  stream: two RMSNorms, the q/k/v projection, Q K^T, the attention-weighted sum of V, o_proj, gate/up,
  down_proj. A difference made in one is carried on by the residual stream; the RMSNorms rescale every
  layer's input, so layers neither amplify nor damp it relative to the stream. Differences from
  independent stages add like a random walk: after ``D`` stages, ``sqrt(D) * e``.
- Hidden states after ``N`` layers (``D = 8 N``): ``rel_norm = ||got - ref|| / ||ref|| <= sqrt(D) * e``.
  The largest of up to 10^8 element deviations lies within ``MAX_SIGMAS`` = 6 of their spread
  (``sqrt(2 ln 10^8)`` = 6.1 for Gaussian deviations): ``max_error = max|got - ref| / max|ref| <=
  6 * sqrt(D) * e``.
- Logits: two stages more (the final norm and lm_head). ``target_probs`` are a softmax of logits, so
  ``|dp_i| = p_i |dl_i - sum_j p_j dl_j| <= 2 p_max max|dl|``, with ``max|dl| <= logits.max_error *
  max|logit|``: the probabilities' bounds are ``2 * max|logit|`` times the logits' (the scale is the
  reference batch's own, measured when needed).
- ``argmax_ids`` and ``position_mask`` (both from the full-vocab argmax) may differ only at near-ties:
  where the reference's top-2 logit margin is at most ``2 * max|dl|``.
- ``input_ids`` and ``loss_mask`` are the request's own, shifted: always exact.

The figures these give for the tiny test target and the 8B shape, and what the kernels were measured
to give, are in docs/equality.md and BENCHMARKS.md ("Batch composition").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import torch

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
ACCUMULATE = torch.float32  # what the GEMM and reduction kernels sum in, for every dtype above
REDUCTIONS_PER_LAYER = 8
LOGIT_STAGES = 2  # the final norm and lm_head
MAX_SIGMAS = 6.0

EXACT = frozenset({"input_ids", "loss_mask"})  # the request's own tensors
NEAR_TIE = frozenset({"argmax_ids", "position_mask"})  # from the full-vocab argmax
PROBS = "target_probs"


def unit_roundoff(dtype: torch.dtype) -> float:
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"no composition tolerance for {dtype}; floating dtypes: {sorted(map(str, UNIT_ROUNDOFF))}")
    return UNIT_ROUNDOFF[dtype]


@dataclasses.dataclass(frozen=True)
class Bound:
    """``rel_norm``: ||got - ref|| / ||ref||; ``max_error``: max|got - ref| / max|ref|."""

    rel_norm: float
    max_error: float

    @classmethod
    def derive(cls, dtype: torch.dtype, stages: int, reduction: int) -> Bound:
        """After ``stages`` reductions in series, the longest of length ``reduction`` (module docstring)."""
        if stages < 1 or reduction < 1:
            raise ValueError(f"stages and reduction must be >= 1, got {stages}, {reduction}")
        per_stage = 2 * unit_roundoff(dtype) + math.sqrt(reduction) * unit_roundoff(ACCUMULATE)
        rel_norm = math.sqrt(stages) * per_stage
        return cls(rel_norm=rel_norm, max_error=MAX_SIGMAS * rel_norm)

    def scaled(self, factor: float) -> Bound:
        return Bound(self.rel_norm * factor, self.max_error * factor)


@dataclasses.dataclass(frozen=True)
class ReferenceLogits:
    """What the bounds of ``target_probs``, ``argmax_ids`` and ``position_mask`` need from the reference's
    full-vocab logits: their largest magnitude, and the top-1 minus top-2 margin at each position, aligned
    with ``argmax_ids`` (shifted left by one, as the contract shifts them)."""

    scale: float
    margins: torch.Tensor  # [B, S]

    @classmethod
    def of(cls, logits: torch.Tensor) -> ReferenceLogits:
        """From the reference forward's logits ``[B, S, V]`` (unshifted)."""
        logits = logits.float()
        top = logits.topk(2, dim=-1).values
        margins = torch.zeros(logits.shape[:2], dtype=torch.float32, device=logits.device)
        margins[:, :-1] = (top[..., 0] - top[..., 1])[:, 1:]
        return cls(scale=float(logits.abs().max()), margins=margins)


@dataclasses.dataclass(frozen=True)
class CompositionTolerance:
    """The derived bounds of one target (module docstring): hidden states, and its logits."""

    hidden: Bound
    logits: Bound

    @classmethod
    def derive(cls, dtype: torch.dtype, num_layers: int, reduction: int) -> CompositionTolerance:
        """For a target of ``num_layers`` decoder layers in ``dtype`` whose longest reduction (the MLP's
        intermediate size) is ``reduction``."""
        stages = REDUCTIONS_PER_LAYER * num_layers
        return cls(hidden=Bound.derive(dtype, stages, reduction),
                   logits=Bound.derive(dtype, stages + LOGIT_STAGES, reduction))

    @classmethod
    def one_gemm(cls, dtype: torch.dtype, reduction: int) -> CompositionTolerance:
        """Between two batches of one forward whose draft logits alone were computed apart: a compact client's
        from the ``[Vd, H]`` lm_head slice, the engine's from the ``[V, H]`` lm_head (``reduction`` = H). Hidden
        states exact; the logits one reduction in another order (one stage)."""
        return cls(hidden=Bound(0.0, 0.0), logits=Bound.derive(dtype, 1, reduction))

    def violations(self, got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor],
                   logits: ReferenceLogits | None = None) -> list[str]:
        """What in ``got`` lies outside the tolerance of ``want`` (the reference composition), one line
        each; empty if all is within it. ``logits``: the reference's, needed to judge ``target_probs``
        and any argmax that differs."""
        if sorted(got) != sorted(want):
            return [f"tensors {sorted(got)} != {sorted(want)}"]
        out = []
        for name, w in want.items():
            g = got[name].to(w.device)
            if g.dtype != w.dtype or g.shape != w.shape:
                out.append(f"{name}: {g.dtype}{list(g.shape)} != {w.dtype}{list(w.shape)}")
            elif not torch.equal(g, w):
                out += self._judge(name, g, w, logits)
        return out

    def _judge(self, name: str, got: torch.Tensor, want: torch.Tensor, logits: ReferenceLogits | None) -> list[str]:
        if name in EXACT or not (got.is_floating_point() or name in NEAR_TIE):
            return [f"{name}: differs, and is exact in every composition"]
        if logits is None and (name in NEAR_TIE or name == PROBS):
            return [f"{name}: differs; judging it needs the reference's logits"]
        if name in NEAR_TIE:
            assert logits is not None
            return _flips(name, got, want, logits, 2 * self.logits.max_error * logits.scale)
        bound = self.hidden if name != PROBS else self.logits.scaled(2 * logits.scale)  # type: ignore[union-attr]
        rel_norm, max_error = deviation(got, want)
        return [f"{name}: {measure} {value:.3g} > {limit:.3g}"
                for measure, value, limit in (("rel_norm", rel_norm, bound.rel_norm),
                                              ("max_error", max_error, bound.max_error)) if value > limit]

def deviation(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """``(rel_norm, max_error)`` of ``got`` against ``want`` (see :class:`Bound`)."""
    g, w = got.double(), want.double()
    diff = g - w
    rel_norm = float(diff.norm() / w.norm()) if w.norm() > 0 else float(diff.norm() > 0) * math.inf
    top = float(w.abs().max()) if w.numel() else 0.0
    max_error = float(diff.abs().max()) / top if top > 0 else (math.inf if diff.abs().max() > 0 else 0.0)
    return rel_norm, max_error


def _flips(name: str, got: torch.Tensor, want: torch.Tensor, logits: ReferenceLogits, limit: float) -> list[str]:
    where = (got != want).reshape(want.shape[0], want.shape[1], -1).any(-1)
    margins = logits.margins.to(where.device)[where]
    clear = margins[margins > limit]
    if not clear.numel():
        return []
    return [f"{name}: {clear.numel()} of {int(where.sum())} differing positions are no near-tie "
            f"(top-2 logit margin up to {float(clear.max()):.3g} > {limit:.3g})"]


def measure(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    """Per floating tensor that differs, ``{"rel_norm": .., "max_error": ..}``; per other tensor that differs,
    ``{"differing": fraction of elements}``: what a test or benchmark prints."""
    out: dict[str, dict[str, float]] = {}
    for name, w in want.items():
        g = got[name].to(w.device)
        if torch.equal(g, w):
            continue
        if w.is_floating_point():
            rel_norm, max_error = deviation(g, w)
            out[name] = {"rel_norm": rel_norm, "max_error": max_error}
        else:
            out[name] = {"differing": float((g != w).float().mean())}
    return out
