"""FP8 (float8_e4m3fn) for hidden states, with one float32 scale per token: the one codec that the wire's
``wire_dtype="fp8"`` and the supervision cache's FP8 storage share. A reply's hidden states concatenate
captured layers, so they get one scale per token and layer (``quantize_blocks``, ``quantize_reply``).

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


# ---------------------------------------------------------------- replies on the wire (wire_dtype="fp8")

# A quantized tensor ``NAME`` travels with ``NAME_scale``: float32 ``[..., blocks]``, one scale per token
# and per block of ``hidden_size`` elements (a captured layer: aux_hidden_states holds three, and layers
# differ in magnitude, so each gets its own scale).
SCALE_SUFFIX = "_scale"


def quantize_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize`` per block of ``block`` elements of the last dimension: ``(q, scale)``, q float8_e4m3fn of
    x's shape, scale float32 ``[..., x.shape[-1] // block]``."""
    if block <= 0 or x.dim() == 0 or x.shape[-1] % block:
        raise ValueError(f"a last dimension of {tuple(x.shape)[-1:]} is not whole blocks of {block}")
    q, scale = quantize(x.unflatten(-1, (-1, block)))
    return q.flatten(-2), scale.squeeze(-1)


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of ``quantize_blocks`` (within its rounding), in ``dtype`` on q's device."""
    if scale.dim() != q.dim() or scale.shape[-1] <= 0 or q.shape[-1] % scale.shape[-1]:
        raise ValueError(f"an fp8 scale of shape {tuple(scale.shape)} does not divide a tensor of shape "
                         f"{tuple(q.shape)} into blocks")
    blocks = scale.shape[-1]
    return dequantize(q.unflatten(-1, (blocks, -1)), scale.unsqueeze(-1), dtype).flatten(-2)


def quantize_reply(tensors: dict[str, torch.Tensor], names: tuple[str, ...],
                   block: int) -> dict[str, torch.Tensor]:
    """``tensors`` with each of ``names`` present as float8_e4m3fn followed by its ``NAME_scale``; the
    others as they are (ValueError, from ``quantize``, for a tensor holding NaN or infinity)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name in names:
            out[name], out[name + SCALE_SUFFIX] = quantize_blocks(t, block)
        else:
            out[name] = t
    return out


def restore_reply(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A reply of ``quantize_reply`` with every quantized tensor back in ``dtype`` and the scales gone."""
    out = {}
    for name, t in tensors.items():
        scale = tensors.get(name + SCALE_SUFFIX)
        if scale is not None and t.dtype == FP8_DTYPE:
            out[name] = dequantize_blocks(t, scale, dtype)
        elif not (name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) in tensors):
            out[name] = t
    return out
