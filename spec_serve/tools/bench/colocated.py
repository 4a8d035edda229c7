"""Colocated scenarios: the target's own forward in this process."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, cast

import torch

from spec_serve.tools.bench.batches import _nbytes, _sync, _tokens, worker_threads
from spec_serve.tools.bench.checks import _figure, verify_packed

if TYPE_CHECKING:
    from spec_serve.tools.bench.context import Context


def run_colocated(ctx: Context, compact: bool, packed: bool = False, dspark: bool = False,
                  compiled: bool = False) -> dict[str, Any]:
    with worker_threads(ctx.device):
        return _run_colocated(ctx, compact, packed, dspark, compiled)


def _run_colocated(ctx: Context, compact: bool, packed: bool = False, dspark: bool = False,
                   compiled: bool = False) -> dict[str, Any]:
    """The target's own forward, batch after batch: padded (what a trainer runs), compact, DSpark, or packed
    (``HFTarget.generate_packed`` on the host batch, as a packing worker gets it); ``compiled``: on the
    compiled engine. Packed and compiled answers are verified after the clock."""
    from spec_serve.supervision.eagle3 import expand_compact, lm_head_slice

    engine = ctx.compiled_engine() if compiled else ctx.engine()
    device, warmup = ctx.device, ctx.cfg.warmup
    weight = lm_head_slice(engine.get_output_embeddings().weight, ctx.mapping[0]) if compact else None
    mask = ctx.mapping[1].to(device)
    batches = ctx.batches if packed else [tuple(t.to(device) for t in b) for b in ctx.batches]
    outputs: list[dict[str, torch.Tensor]] = []
    nbytes, start = 0, 0.0
    for i, b in enumerate(batches):
        if i == warmup:
            _sync(device)
            start, nbytes, outputs = time.perf_counter(), 0, []
        if compact:
            out = expand_compact(engine.generate_batch(*b, kind="eagle3_compact"), cast(torch.Tensor, weight), mask)
        elif packed:
            out = engine.generate_packed([b], kind="eagle3")[0]
        elif dspark:
            out = engine.generate_batch(*b, kind="dspark")
        else:
            out = engine.generate_batch(*b, kind="eagle3")
        if packed or compiled:
            outputs.append(out)
        else:  # consumed as a remote scenario consumes its batches, and the reference remote ones are checked against
            ctx.keep_reference(i, out, kind="dspark" if dspark else "eagle3", compact=compact)
        nbytes += _nbytes(out)
    _sync(device)
    seconds = time.perf_counter() - start
    tokens, padded = _tokens(ctx.batches[warmup:])
    name = "colocated_compact" if compact else "colocated_packed" if packed else "colocated_dspark" if dspark \
        else "colocated"
    if compiled:
        name += "_compiled"
        return _figure(name, tokens, nbytes, seconds, padded, **ctx.verify_compiled(ctx.batches[warmup:], outputs))
    checked = verify_packed(engine, ctx.batches[warmup:], outputs, flip_bounds=ctx.flip_bounds) if packed else {}
    return _figure(name, tokens, nbytes, seconds, padded, **checked)
