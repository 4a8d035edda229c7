"""Is a remote batch what the colocated forward gives for the same input? (``spec-serve bench`` and
``benchmarks/gpu_matrix.py``).

The reference is computed as a remote client receives it: each shard's rows by themselves (what each
worker computed: a GPU picks GEMM kernels by shape, so rows computed with others may differ in low
bits), concatenated; a compact batch expanded on the client's device after gathering, from the
lm_head slice the client caches. Equality is ``torch.equal``, tensor by tensor.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from spec_serve.client.api import shard_bounds
from spec_serve.supervision.eagle3 import expand_compact, lm_head_slice


def sharded_forward(engine, batch: tuple[torch.Tensor, ...], wire_kind: str,
                    shards: int = 1) -> dict[str, torch.Tensor]:
    """``engine``'s outputs of ``wire_kind`` for ``batch`` (input_ids, attention_mask, loss_mask), each of
    the client's ``shards`` row ranges computed alone, concatenated; on the engine's device."""
    parts = [engine.generate_batch(*(t[lo:hi] for t in batch), kind=wire_kind)
             for lo, hi in shard_bounds(batch[0].shape[0], shards)]
    return parts[0] if len(parts) == 1 else {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def expanded(compact: Mapping[str, torch.Tensor], weight: torch.Tensor, selected_mask: torch.Tensor,
             device: torch.device | str) -> dict[str, torch.Tensor]:
    """A compact batch expanded on ``device``, as a client there does (``weight``: the lm_head slice)."""
    device = torch.device(device)
    return expand_compact({k: v.to(device) for k, v in compact.items()}, weight.to(device), selected_mask.to(device))


def colocated_reference(engine, batch: tuple[torch.Tensor, ...], kind: str, *, shards: int = 1,
                        compact: bool = False, device: torch.device | str | None = None,
                        selected: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """``engine``'s answer to ``batch`` as a client with ``shards`` shards gets it, on the engine's
    device; with ``compact`` (EAGLE-3), expanded on ``device`` with the draft-vocab mapping ``selected``
    = (selected_token_ids, selected_token_mask)."""
    out = sharded_forward(engine, batch, "eagle3_compact" if compact else kind, shards)
    if not compact:
        return out
    if selected is None:
        raise ValueError("a compact reference needs the draft-vocab mapping (selected)")
    weight = lm_head_slice(engine.get_output_embeddings().weight, selected[0])
    return expanded(out, weight, selected[1], device or engine.device)


def mismatch(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> str | None:
    """None when ``got`` equals ``want`` bit for bit (names, dtypes, shapes, values); else what differs."""
    if sorted(got) != sorted(want):
        return f"tensors {sorted(got)} != {sorted(want)}"
    for name, w in want.items():
        g = got[name]
        if g.dtype != w.dtype or g.shape != w.shape:
            return f"{name}: {g.dtype}{list(g.shape)} != {w.dtype}{list(w.shape)}"
        w = w.to(g.device)
        if not torch.equal(g, w):
            if g.is_floating_point():
                diff = (g.float() - w.float()).abs().max().item()
                return f"{name}: max abs diff {diff:.3g}"
            return f"{name}: {int((g != w).sum())} elements differ"
    return None
