"""Is a remote batch what the colocated forward gives for the same input? (``spec-serve bench`` and
``benchmarks/gpu_matrix.py``).

The reference is computed as a remote client receives it: each shard's rows by themselves (what each
worker computed: a GPU picks GEMM kernels by shape, so rows computed with others may differ in low
bits), concatenated; a compact batch expanded on the client's device after gathering, from the
lm_head slice the client caches. Equality is ``torch.equal``, tensor by tensor.
"""

from __future__ import annotations

from typing import Mapping

import torch

from spec_serve.client import shard_bounds
from spec_serve.compact import expand_compact, lm_head_slice


def colocated_reference(engine, batch: tuple[torch.Tensor, ...], kind: str, *, shards: int = 1,
                        compact: bool = False, device: torch.device | str | None = None,
                        selected: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """``engine``'s answer to ``batch`` (input_ids, attention_mask, loss_mask) as a client with
    ``shards`` shards gets it, on the engine's device; with ``compact`` (EAGLE-3), expanded on ``device``
    with the draft-vocab mapping ``selected`` = (selected_token_ids, selected_token_mask)."""
    wire_kind = "eagle3_compact" if compact else kind
    parts = [engine.generate_batch(*(t[lo:hi] for t in batch), kind=wire_kind)
             for lo, hi in shard_bounds(batch[0].shape[0], shards)]
    out = parts[0] if len(parts) == 1 else {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    if not compact:
        return out
    if selected is None:
        raise ValueError("a compact reference needs the draft-vocab mapping (selected)")
    device = torch.device(device or engine.device)
    weight = lm_head_slice(engine.get_output_embeddings().weight, selected[0]).to(device)
    return expand_compact({k: v.to(device) for k, v in out.items()}, weight, selected[1].to(device))


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
