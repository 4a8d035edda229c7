"""spec_serve.tools.verify: references as a client receives them, bit-for-bit comparison, the contract check."""

from __future__ import annotations

import torch

from spec_serve.client.assembly import shard_bounds
from spec_serve.supervision.eagle3 import expand_compact, lm_head_slice
from spec_serve.tools.tiny import sample_batch
from spec_serve.tools.verify import check_contract, colocated_reference, mismatch, words


def test_mismatch_names_what_differs():
    a = {"x": torch.arange(4.0), "m": torch.tensor([True, False])}
    assert mismatch(a, {k: v.clone() for k, v in a.items()}) is None
    assert "max abs diff 1" in mismatch(a, dict(a, x=torch.arange(4.0) + 1))
    assert "1 elements differ" in mismatch(a, dict(a, m=torch.tensor([True, True])))
    assert "torch.float64" in mismatch(a, dict(a, x=torch.arange(4.0, dtype=torch.float64)))
    assert "tensors" in mismatch(a, {"x": a["x"]})


def test_bits_compare_every_byte_through_the_widest_view_the_layout_allows():
    """bits=True (bench_netns's check of every reply) finds one flipped bit anywhere, in a padded-batch slice
    too, and tells bytes from values: a signed zero differs in bits, not in value."""
    full = torch.randn(3, 10, 64).to(torch.bfloat16)
    for view in (full, full[:, :7], full[:, 1:6, 3:9], full[1, 2, 5]):
        for k in range(view.numel()):
            flipped = view.clone()
            flipped.view(-1).view(torch.int16)[k] ^= 1 << (k % 16)
            assert mismatch({"x": view}, {"x": flipped}, bits=True) is not None, (tuple(view.shape), k)
        assert mismatch({"x": view}, {"x": view.clone()}, bits=True) is None
    assert words(full[:, :7], full[:, :7].clone())[0].dtype == torch.int64  # rows of 128 bytes: 8-byte words
    assert words(full[:, :, 1:4], full[:, :, 1:4].clone())[0].dtype == torch.int16  # 6 bytes at an odd offset
    zeros = torch.zeros(4)
    assert mismatch({"x": zeros}, {"x": -zeros}) is None  # torch.equal: -0.0 == 0.0
    assert "signed zero" in mismatch({"x": zeros}, {"x": -zeros}, bits=True)
    masks = torch.tensor([True, False]), torch.tensor([True, True])
    assert "1 elements differ" in mismatch({"m": masks[0]}, {"m": masks[1]}, bits=True)


def test_shard_bounds_split_rows_into_near_equal_parts():
    assert shard_bounds(5, 2) == [(0, 3), (3, 5)]
    assert shard_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert shard_bounds(2, 4) == [(0, 1), (1, 2)]  # never an empty shard
    assert shard_bounds(4, 1) == [(0, 4)]


def test_references_compute_each_shard_alone(colocated_target, tiny_target_dir, tiny_vocab_mapping):
    """A sharded reference is each shard's rows computed by themselves (the forward each worker ran), and
    the compact one is that, expanded after gathering; check_contract accepts the reference itself."""
    engine = colocated_target()
    rows_seen = []
    forward = engine.generate_batch
    engine.generate_batch = lambda ids, *a, **kw: rows_seen.append(ids.shape[0]) or forward(ids, *a, **kw)
    batch = sample_batch(tiny_target_dir, 3, 24, seed=4)
    sharded = colocated_reference(engine, batch, "eagle3", shards=2)
    assert rows_seen == [2, 1]
    rows_seen.clear()
    compact = colocated_reference(engine, batch, "eagle3", shards=3, compact=True, selected=tiny_vocab_mapping)
    assert rows_seen == [1, 1, 1]
    raw = colocated_reference(engine, batch, "eagle3_compact", shards=3)
    weight = lm_head_slice(engine.get_output_embeddings().weight, tiny_vocab_mapping[0])
    assert mismatch(compact, expand_compact(raw, weight, tiny_vocab_mapping[1])) is None
    for got, kind, shards, kw in ((sharded, "eagle3", 2, {}),
                                  (compact, "eagle3", 3, {"compact": True, "selected": tiny_vocab_mapping})):
        check = check_contract(got, engine, batch, kind, shards=shards, **kw)
        assert check.ok and check.shard_mismatch is None, check.describe()
        print(f"\n{kind} shards={shards}: {check.describe()}")
