"""What a scenario reports and how its answers are checked: a figure, packed answers within packing's tolerance, flip
bounds, ``verified=N/M``."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch


def _figure(name: str, tokens: int, nbytes: int, seconds: float, padded_tokens: int | None = None,
            **extra) -> dict[str, Any]:
    """One scenario's figure: ``tokens`` are useful (real) tokens; ``padded_tokens`` what the padded
    batches held (rows x padded length), where the scenario ran training batches."""
    figure = {"scenario": name, "tokens": tokens, "bytes": nbytes, "seconds": round(seconds, 6),
              "tokens_per_s": round(tokens / seconds, 1) if seconds else None,
              "gb_per_s": round(nbytes / seconds / 1e9, 4) if seconds else None}
    if padded_tokens is not None:
        figure.update(padded_tokens=padded_tokens,
                      padded_tokens_per_s=round(padded_tokens / seconds, 1) if seconds else None)
    return {**figure, **extra}


def verify_packed(engine, batches, outputs, compact_mask: torch.Tensor | None = None,
                  flip_bounds: Callable[[tuple, dict | None], dict[str, float]] | None = None) -> dict[str, Any]:
    """Each packed or compiled answer against the colocated padded eager forward of its batch
    (``packing.compare``; ``compiled.TOLERANCE`` is the same table), its flips against the bound derived for
    that batch (``engines.flips``: what a deviation at the tolerance's hidden rel_norm flips on these rows).

    ``compact_mask``: the outputs are compact replies expanded by a client (``selected_token_mask``
    given), so the reference is the colocated compact forward expanded the same way; else the
    colocated EAGLE-3 forward. ``flip_bounds(batch, eagle3_reference_or_None)``: a batch's flip bound
    (``Context.flip_bounds`` keeps them over rounds; computed here if not given). Returns ``verified`` "N/M"
    (M batches, N within the tolerance for the model's dtype), the tolerance, the worst value of each measure
    over all batches, the lowest flip bound, and ``status: INVALID`` unless N == M.
    """
    from spec_serve.engines import packing

    tolerance = packing.TOLERANCE[engine.model.dtype]
    bound_of = flip_bounds or functools.partial(_flip_bounds, engine)
    worst: dict[str, float] = {}
    lowest: dict[str, float] = {}
    passed, failures = 0, []
    for b, out in zip(batches, outputs):
        want = _padded_reference(engine, b, compact_mask)
        bounds = bound_of(b, want if compact_mask is None else None)
        report = packing.compare(out, want, b[1].to(engine.device))
        for name, measures in report.items():
            for measure, value in measures.items():
                worst[f"{name}.{measure}"] = max(worst.get(f"{name}.{measure}", 0.0), value)
        lowest = {name: min(lowest.get(name, bound), bound) for name, bound in bounds.items()}
        bad = packing.violations(report, tolerance, bounds)
        passed += not bad
        failures += bad[:1]
    result = {"verified": f"{passed}/{len(outputs)}",
              "tolerance": {**dataclasses.asdict(tolerance), "flip_rate": "derived per batch (flip_bound)"},
              "worst": {k: float(f"{v:.3g}") for k, v in sorted(worst.items())},
              "flip_bound": {k: float(f"{v:.3g}") for k, v in sorted(lowest.items())}}
    if passed != len(outputs) or not outputs:
        result.update(status="INVALID", first_failures=failures[:3])
    return result


def _padded_reference(engine, batch, compact_mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The colocated padded eager forward of ``batch``: EAGLE-3, or (``compact_mask``) compact expanded."""
    from spec_serve.supervision.eagle3 import expand_compact, lm_head_slice

    if compact_mask is None:
        return engine.generate_batch(*batch, kind="eagle3")
    weight = lm_head_slice(engine.get_output_embeddings().weight, engine.vocab_mapping()[0])
    return expand_compact(engine.generate_batch(*batch, kind="eagle3_compact"), weight,
                          compact_mask.to(engine.device))


def _flip_bounds(engine, batch, reference: dict | None) -> dict[str, float]:
    """``batch``'s flip bound at the tolerance's hidden rel_norm (``engines.flips.flip_bound``)."""
    from spec_serve.engines import packing
    from spec_serve.engines.flips import flip_bound

    rel_norm = packing.TOLERANCE[engine.model.dtype].hidden_rel_norm
    return flip_bound(engine, tuple(t.to(engine.device) for t in batch), rel_norm, reference=reference)


def verified(passed: int, total: int) -> dict[str, Any]:
    """A figure's verification fields: ``verified`` "N/M", and ``status: INVALID`` unless all M passed."""
    return {"verified": f"{passed}/{total}", **({} if passed == total and total else {"status": "INVALID"})}


def _row_noise(engine, batch) -> dict[str, float]:
    from spec_serve.engines import packing

    ids, attn, loss = (t.to(engine.device) for t in batch)
    inside = engine.generate_batch(ids, attn, loss, kind="eagle3")
    worst: dict[str, float] = {}
    for row, n in enumerate(attn.sum(1).tolist()):
        alone = engine.generate_batch(ids[row:row + 1, :n], attn[row:row + 1, :n], loss[row:row + 1, :n],
                                      kind="eagle3")
        same_rows = {name: t[row:row + 1, :n] for name, t in inside.items()}
        for name, measures in packing.compare(alone, same_rows, attn[row:row + 1, :n]).items():
            for measure, value in measures.items():
                if measure != "mismatch":  # input_ids, loss_mask: exact by construction
                    worst[f"{name}.{measure}"] = max(worst.get(f"{name}.{measure}", 0.0), value)
    return worst
