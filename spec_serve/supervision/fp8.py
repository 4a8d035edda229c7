"""FP8 (float8_e4m3fn) for hidden states, with one float32 scale per token: the one codec that the wire's
``wire_dtype="fp8"`` and the supervision cache's FP8 storage share.

A token's scale is its largest magnitude over the last dimension divided by e4m3's largest finite value
(448), so every element of a finite row maps into e4m3's range and no element saturates. A row of zeros
gets the scale 1 (its elements quantize to exact zeros). Error bound: e4m3 keeps 3 mantissa bits, so an
element's relative rounding error is at most 2**-4 (subnormals, under 2**-6 x scale, round to a multiple
of 2**-9 x scale); docs/equality.md states the error measured at the 8B shape.

Invariant: ``dequantize(*quantize(x), x.dtype)`` has x's shape, dtype and device, and is bit-exact for
every element that is a multiple of its scale representable in e4m3 (zeros included).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``q`` float8_e4m3fn of x's shape, ``scale`` float32 ``[..., 1]`` (one per token).

    ValueError for a tensor that is not floating point or holds a NaN or an infinity (no scale represents
    them; a target that produces them is broken and must not be hidden by the codec).
    """
    if not x.is_floating_point() or x.dim() == 0:
        raise ValueError(f"fp8 quantizes floating-point tensors of at least one dimension, not {x.dtype} "
                         f"of shape {tuple(x.shape)}")
    x32 = x.float()
    amax = x32.abs().amax(dim=-1, keepdim=True)
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("fp8 cannot quantize a tensor holding NaN or infinity")
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x32 / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The tensor ``quantize`` was given, within its rounding, in ``dtype`` on q's device."""
    if q.dtype != FP8_DTYPE:
        raise ValueError(f"fp8 dequantizes {FP8_DTYPE} tensors, not {q.dtype}")
    if scale.dtype != torch.float32 or scale.shape != (*q.shape[:-1], 1):
        raise ValueError(f"an fp8 scale must be float32 of shape {(*q.shape[:-1], 1)}, not {scale.dtype} "
                         f"of shape {tuple(scale.shape)}")
    return (q.float() * scale.to(q.device)).to(dtype)


def relative_error(x: torch.Tensor) -> float:
    """||dequantize(quantize(x)) - x|| / ||x|| over the whole tensor, in float64 (0 for a zero tensor)."""
    back = dequantize(*quantize(x), x.dtype).double()
    ref = x.double()
    norm = ref.norm()
    return 0.0 if norm == 0 else float((back - ref).norm() / norm)
