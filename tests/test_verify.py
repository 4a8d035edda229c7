"""spec_serve.tools.verify: references as a client receives them, and bit-for-bit comparison."""

from __future__ import annotations

import torch

from spec_serve.tools.tiny import sample_batch
from spec_serve.tools.verify import colocated_reference, mismatch


def test_mismatch_names_what_differs():
    a = {"x": torch.arange(4.0), "m": torch.tensor([True, False])}
    assert mismatch(a, {k: v.clone() for k, v in a.items()}) is None
    assert "max abs diff 1" in mismatch(a, dict(a, x=torch.arange(4.0) + 1))
    assert "1 elements differ" in mismatch(a, dict(a, m=torch.tensor([True, True])))
    assert "torch.float64" in mismatch(a, dict(a, x=torch.arange(4.0, dtype=torch.float64)))
    assert "tensors" in mismatch(a, {"x": a["x"]})


def test_sharded_and_compact_references_on_cpu(colocated_target, tiny_target_dir, tiny_vocab_mapping):
    """On CPU a row's outputs do not depend on its batch-mates: per-shard references equal the whole
    batch's, and the compact reference is the engine's compact batch expanded."""
    engine = colocated_target()
    batch = sample_batch(tiny_target_dir, 3, 24, seed=4)
    whole = engine.generate_batch(*batch, kind="eagle3")
    assert mismatch(colocated_reference(engine, batch, "eagle3", shards=2), whole) is None
    compact = colocated_reference(engine, batch, "eagle3", shards=3, compact=True, selected=tiny_vocab_mapping)
    assert mismatch(compact, colocated_reference(engine, batch, "eagle3", compact=True, selected=tiny_vocab_mapping)) \
        is None
    assert torch.equal(compact["aux_hidden_states"], whole["aux_hidden_states"])
