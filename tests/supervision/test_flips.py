"""The derived flip bound (``engines.flips``): the flips a deviation of the final hidden state of a given
relative size causes on the reference's own rows, which bounds ``argmax_ids``/``position_mask`` flips of a
compiled or packed answer in place of a fixed rate (docs/compile.md, "Why these bounds")."""

from __future__ import annotations

import torch

from spec_serve.engines import packing
from spec_serve.engines.flips import flip_bound, moved_final_hidden
from spec_serve.tools.tiny import sample_batch
from spec_serve.tools.verify import mismatch


def test_moving_the_final_hidden_state_moves_it_by_rel_norm_and_only_within_the_block(colocated_target,
                                                                                       tiny_target_dir):
    engine = colocated_target()
    batch = sample_batch(tiny_target_dir, 4, 48, seed=3)
    seen: list[torch.Tensor] = []
    handle = engine.get_output_embeddings().register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    try:
        reference = engine.generate_batch(*batch)
        with moved_final_hidden(engine, 0.05, seed=1):
            # Registered inside the block, so it runs after the move: it sees what lm_head gets.
            inner = engine.get_output_embeddings().register_forward_pre_hook(lambda m, args: seen.append(args[0]))
            engine.generate_batch(*batch)
            inner.remove()
    finally:
        handle.remove()
    clean, moved = seen[0].float(), seen[-1].float()
    per_position = (moved - clean).norm(dim=-1) / clean.norm(dim=-1)
    assert 0.04 < float(per_position.mean()) < 0.06
    assert mismatch(engine.generate_batch(*batch), reference) is None  # the hook is gone


def test_the_bound_grows_with_the_deviation_and_is_reproducible(colocated_target, tiny_target_dir):
    engine = colocated_target()
    batch = sample_batch(tiny_target_dir, 8, 64, seed=4)
    reference = engine.generate_batch(*batch)
    assert flip_bound(engine, batch, 0.0, reference=reference) == {"position_mask": 0.0}
    small, large = (flip_bound(engine, batch, rho, reference=reference)["position_mask"] for rho in (0.01, 0.3))
    assert 0 < small < large < 1
    assert flip_bound(engine, batch, 0.3, reference=reference)["position_mask"] == large
    compact = flip_bound(engine, batch, 0.3, kind="eagle3_compact")
    assert set(compact) == {"argmax_ids"} and compact["argmax_ids"] > 0


def test_a_derived_flip_bound_replaces_the_fixed_rate():
    tolerance = packing.TOLERANCE[torch.bfloat16]
    report = {"position_mask": {"flip_rate": 0.02}, "aux_hidden_states": {"rel_norm": 0.01}}
    assert packing.violations(report, tolerance) == []  # the fixed 5%
    assert packing.violations(report, tolerance, {"position_mask": 0.03}) == []
    assert packing.violations(report, tolerance, {"position_mask": 0.01}) == ["position_mask: flip_rate 0.02 > 0.01"]
    assert packing.violations({"argmax_ids": {"flip_rate": 0.06}}, tolerance, {"position_mask": 0.1}) == [
        "argmax_ids: flip_rate 0.06 > 0.05"]  # a tensor without a derived bound keeps the fixed one
