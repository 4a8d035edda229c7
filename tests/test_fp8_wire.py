"""FP8 on the wire (``wire_dtype="fp8"``) through a real broker and worker: the hidden states travel as
float8_e4m3fn with a float32 scale per token and captured layer, and come back in the model dtype.

Two checks, for every path that carries bytes (frames, the same-host plane) and every kind:
- bit for bit: the remote batch equals the colocated forward put through ``fp8.quantize_reply`` and
  ``fp8.restore_reply`` (``verify.fp8_round_trip``): quantizing and restoring are elementwise per token
  and layer, so neither sharding nor the client's device changes a bit;
- against the unquantized colocated forward, every hidden-state element within e4m3's rounding
  (``within_fp8_rounding``), which a scale misapplied or swapped between rows breaks (the check above
  cannot see a bug that the codec and its reference share).
"""

from __future__ import annotations

import pytest
import torch

from spec_serve.client.api import RemoteTargetModel
from spec_serve.supervision.contract import HIDDEN_STATE_TENSORS
from spec_serve.tools.launch import local_cluster
from spec_serve.tools.tiny import sample_batch
from spec_serve.tools.verify import colocated_reference, mismatch


@pytest.fixture(scope="module")
def cluster(tiny_target_dir):
    with local_cluster(tiny_target_dir, workers=1) as c:
        yield c


def within_fp8_rounding(got: torch.Tensor, want: torch.Tensor, hidden: int) -> bool:
    """Every element of ``got`` within FP8's rounding of ``want``'s (docs/equality.md): e4m3 keeps 3 mantissa
    bits (2**-4 relative), a subnormal rounds by half a step (2**-10 of its block's scale, amax / 448), and
    the restored value rounds once more to the model dtype (bf16: 2**-8 relative)."""
    x, y = want.double(), got.double()
    blocks = x.unflatten(-1, (-1, hidden))
    scale = (blocks.abs().amax(-1, keepdim=True) / 448).expand_as(blocks).flatten(-2)
    return bool(((y - x).abs() <= x.abs() * (2**-4 + 2**-8) + scale * 2**-10).all())


def _check(got, engine, batch, kind, **ref) -> None:
    want = colocated_reference(engine, batch, kind, wire_fp8=True, **ref)
    assert mismatch(got, want) is None, mismatch(got, want)
    plain = colocated_reference(engine, batch, kind, **ref)
    hidden = engine.target_info().hidden_size
    for name in HIDDEN_STATE_TENSORS:
        if name in got:
            assert not torch.equal(got[name], plain[name])  # it did travel as FP8
            assert within_fp8_rounding(got[name], plain[name], hidden), name


@pytest.mark.parametrize("plane", [False, True], ids=["frames", "plane"])
def test_fp8_replies_equal_the_colocated_round_trip(cluster, tiny_target_dir, tiny_vocab_mapping, colocated_target,
                                                     plane):
    engine = colocated_target()
    with RemoteTargetModel(cluster.frontend, wire_dtype="fp8", same_host_plane=plane, num_shards=2,
                           prefetch_depth=2, timeout=60) as client:
        client.set_vocab_mapping(*tiny_vocab_mapping)
        batches = [sample_batch(tiny_target_dir, 4, 24 + 8 * seed, seed=seed) for seed in range(2)]
        futures = [(b, client.generate_batch_async(*b, kind="eagle3")) for b in batches]
        for batch, future in futures:  # compact="auto": compact over frames, full through the plane
            _check(future.result(), engine, batch, "eagle3", shards=2, compact=not plane,
                   selected=tiny_vocab_mapping)
        dspark = sample_batch(tiny_target_dir, 3, 20, seed=5)
        _check(client.generate_batch(*dspark, kind="dspark"), engine, dspark, "dspark", shards=2)
        stats = client.stats
    assert (stats.fp8_replies, stats.fp8_declined) == (6, 0)
    assert stats.plane_replies == (6 if plane else 0)
