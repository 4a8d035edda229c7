"""Compact EAGLE-3 through a real broker and worker: fewer bytes, the same tensors.

The worker ships aux + final hidden state + argmax (kind "eagle3_compact"); the client rebuilds
target_probs and position_mask from a draft-vocab lm_head slice it fetched once. Its result must
meet the contract (docs/equality.md) with ``expand_compact`` of the colocated HFTarget's compact output
on the client's device (the same function on the same inputs): each shard bit-equal to the forward of
its rows. Against a full EAGLE-3 batch of the same composition, its position_mask and aux states are
equal exactly (the argmax is the target's own), its target_probs within the tolerance of one GEMM of
another shape (the [Vd,H] slice instead of the [V,H] lm_head).
"""

from __future__ import annotations

import pytest
import torch

from cluster_util import assert_contract, start_nan_worker
from spec_serve.client.api import RemoteTargetModel
from spec_serve.supervision.contract import FP8_TENSORS
from spec_serve.supervision.eagle3 import lm_head_slice
from spec_serve.supervision.tolerance import Bound, deviation
from spec_serve.telemetry.metrics import CLIENT_LM_HEAD_SLICES
from spec_serve.tools.launch import local_cluster
from spec_serve.tools.tiny import sample_batch
from spec_serve.tools.verify import colocated_reference, mismatch, reference_logits


def _nbytes(batch):
    return sum(t.numel() * t.element_size() for t in batch.values())


def _assert_probs_within_one_gemm(got: torch.Tensor, full: torch.Tensor, engine, batch) -> None:
    """A compact batch's target_probs against a full batch of the same composition: only the lm_head GEMM
    differs (the [Vd,H] slice instead of the [V,H] lm_head), one reduction of length H, scaled by the
    logits' magnitude (tolerance.py)."""
    one_gemm = Bound.derive(torch.float32, stages=1, reduction=engine.hidden_size)
    limit = one_gemm.scaled(2 * reference_logits(engine, batch).scale)
    rel_norm, max_error = deviation(got, full)
    assert rel_norm <= limit.rel_norm and max_error <= limit.max_error, (rel_norm, max_error, limit)


@pytest.fixture(scope="module")
def cluster(tiny_target_dir):
    with local_cluster(tiny_target_dir, workers=1) as c:
        yield c


def test_compact_remote_equals_colocated(cluster, tiny_target_dir, tiny_vocab_mapping, colocated_target):
    engine = colocated_target()
    ids_map, mask_map = tiny_vocab_mapping
    colocated_slice = lm_head_slice(engine.get_output_embeddings().weight, ids_map)
    with RemoteTargetModel(cluster.frontend, compact=True, num_shards=2, prefetch_depth=2, timeout=60) as remote, \
            RemoteTargetModel(cluster.frontend, num_shards=2, timeout=60) as full_remote:
        remote.set_vocab_mapping(ids_map, mask_map)
        full_remote.set_vocab_mapping(ids_map, mask_map)
        assert torch.equal(remote.lm_head_slice(), colocated_slice)
        futures = []
        sent = remote.stats.sent
        for seed in range(3):
            batch = sample_batch(tiny_target_dir, 4, 48, seed=seed)
            futures.append((batch, remote.generate_batch_async(*batch, kind="eagle3")))
        for batch, future in futures:
            got = future.result()
            assert_contract(got, engine, batch, "eagle3", shards=2, compact=True, selected=tiny_vocab_mapping)
            # Same contract as the anchor's full EAGLE-3 batch of the same composition: exact mask and ids,
            # probs to the rounding of one GEMM (scaled by the logits' magnitude, see tolerance.py).
            full = full_remote.generate_batch(*batch, kind="eagle3")
            assert torch.equal(got["position_mask"], full["position_mask"])
            assert torch.equal(got["aux_hidden_states"], full["aux_hidden_states"])
            _assert_probs_within_one_gemm(got["target_probs"], full["target_probs"], engine, batch)
            # No next token at S-1: remote full, remote compact and colocated all give NeMo's softmax of zeros.
            uniform = torch.softmax(torch.zeros(len(ids_map)), dim=-1).expand(batch[0].shape[0], -1)
            colocated = engine.generate_batch(*batch, kind="eagle3")
            for probs in (got["target_probs"], full["target_probs"], colocated["target_probs"]):
                assert torch.equal(probs[:, -1], uniform)
        assert remote.stats.sent - sent == 3 * 2  # every batch sent as two shards
        # Asking for the compact kind explicitly returns the raw compact tensors.
        batch = sample_batch(tiny_target_dir, 2, 32, seed=9)
        raw = remote.generate_batch(*batch, kind="eagle3_compact")
        assert_contract(raw, engine, batch, "eagle3_compact", shards=2)
        wire_full = _nbytes(full_remote.generate_batch(*batch, kind="eagle3"))
        assert _nbytes(raw) < wire_full


def test_compact_needs_a_mapping(cluster, tiny_target_dir):
    with RemoteTargetModel(cluster.frontend, compact=True, timeout=30) as remote:
        batch = sample_batch(tiny_target_dir, 1, 8, seed=0)
        with pytest.raises(RuntimeError, match="set_vocab_mapping"):
            remote.generate_batch(*batch, kind="eagle3")


def _slices_metric(service: str) -> float:
    return CLIENT_LM_HEAD_SLICES.labels(service=service)._value.get()


def test_auto_is_compact_over_frames_and_full_through_the_plane(cluster, tiny_target_dir, tiny_vocab_mapping,
                                                                colocated_target):
    """compact="auto", the default: a reply that leaves the worker's host (frames; here the plane is off, as a
    client on another host has it) comes compact and is expanded here: the contract (docs/equality.md) with
    the colocated compact batch expanded, within the [Vd,H] GEMM's rounding of the full batch of the same
    composition (tests/worker/test_hf_engine.py); the
    lm_head slice is fetched once per mapping, counted. Through the plane the same client setup gets full
    replies and fetches nothing."""
    engine = colocated_target()
    ids_map, mask_map = tiny_vocab_mapping
    colocated_slice = lm_head_slice(engine.get_output_embeddings().weight, ids_map)
    before = _slices_metric("default")
    with RemoteTargetModel(cluster.frontend, same_host_plane=False, num_shards=2, prefetch_depth=2,
                           timeout=60) as remote:
        assert remote.compact == "auto"
        remote.set_vocab_mapping(ids_map, mask_map)
        assert remote.stats.lm_head_slices == 0  # not before the first request that needs it
        batches = [sample_batch(tiny_target_dir, 4, 40, seed=seed) for seed in range(3)]
        futures = [remote.generate_batch_async(*batches[0], kind="eagle3")]
        # Frames only, so the reply will come compact: the slice was fetched before the request went out, not
        # on its reply (then its request would queue behind the batches in flight, and the pipeline drain).
        assert remote.stats.lm_head_slices == 1
        futures += [remote.generate_batch_async(*batch, kind="eagle3") for batch in batches[1:]]
        for batch, future in zip(batches, futures):
            got = future.result()
            # (compact: also against the full forward of the same composition, within one GEMM's rounding)
            assert_contract(got, engine, batch, "eagle3", shards=2, compact=True, selected=tiny_vocab_mapping)
        stats = remote.stats
        assert stats.compact_replies == 6 and stats.plane_replies == 0
        assert stats.replies["frames"] == 6 + 1  # the six shards and the one lm_head slice
        assert stats.lm_head_slices == 1 and stats.lm_head_slice_bytes == colocated_slice.numel() * 4
        assert _slices_metric("default") == before + 1
        other = (ids_map.flip(0), mask_map)  # another mapping (same ids, another order): one more slice
        remote.set_vocab_mapping(*other)
        # Its values, not only the count: a slice kept under a key both mappings share would be the old one.
        assert_contract(remote.generate_batch(*batches[0], kind="eagle3"), colocated_target(vocab_mapping=other),
                        batches[0], "eagle3", shards=2, compact=True, selected=other)
        assert remote.stats.lm_head_slices == 2
    with RemoteTargetModel(cluster.frontend, num_shards=2, timeout=60) as local:
        local.set_vocab_mapping(ids_map, mask_map)
        for batch in batches:
            assert_contract(local.generate_batch(*batch, kind="eagle3"), engine, batch, "eagle3", shards=2)
        assert local.stats.plane_replies == 6 and local.stats.compact_replies == 0
        assert local.stats.lm_head_slices == 0


def test_compact_must_be_true_false_or_auto(cluster):
    with pytest.raises(ValueError, match="not valid for compact: one of .*auto"):
        RemoteTargetModel(cluster.frontend, compact="sometimes", timeout=30)


@pytest.fixture(scope="module")
def mixed(cluster, tiny_target_dir):
    """Two workers of one service on this host: one lends replies through the plane, one has it off."""
    cluster.start_worker(tiny_target_dir, service="mixed")
    cluster.start_worker(tiny_target_dir, service="mixed", env={"SPEC_SERVE_SAME_HOST_PLANE": "0"})
    cluster.wait_workers(2, service="mixed")
    return cluster


def test_auto_batches_whose_shards_come_in_both_formats(mixed, tiny_target_dir, tiny_vocab_mapping,
                                                        colocated_target):
    """Shards served by a worker that lends through the plane come full, by one that cannot compact; every
    batch is the EAGLE-3 contract either way (the mixed assembly itself: tests/client/test_assemble.py)."""
    engine = colocated_target()
    with RemoteTargetModel(mixed.frontend, service="mixed", num_shards=2, prefetch_depth=2, timeout=60) as remote:
        remote.set_vocab_mapping(*tiny_vocab_mapping)
        batches = [sample_batch(tiny_target_dir, 4, 32, seed=20 + seed) for seed in range(6)]
        futures = [remote.generate_batch_async(*batch, kind="eagle3") for batch in batches]
        for batch, future in zip(batches, futures):
            got, full = future.result(), engine.generate_batch(*batch, kind="eagle3")
            assert got.keys() == full.keys()
            assert all(torch.equal(got[k], full[k]) for k in full if k != "target_probs")
            assert float((got["target_probs"] - full["target_probs"]).abs().max()) <= 1e-6
        stats = remote.stats
        assert 0 < stats.compact_replies < 12 and stats.plane_replies == 12 - stats.compact_replies, stats


# ---------------------------------------------------------------- FP8 on the wire (wire_dtype="fp8")
#
# The hidden states travel as float8_e4m3fn with a float32 scale per token and captured layer, and come
# back in the model dtype. Two checks, for every path that carries bytes (frames, the same-host plane) and
# every kind: bit for bit, the remote batch equals the colocated forward put through fp8.quantize_reply and
# fp8.restore_reply (verify.fp8_round_trip: quantizing and restoring are elementwise per token and layer, so
# neither sharding nor the client's device changes a bit); and against the unquantized colocated forward,
# every hidden-state element within e4m3's rounding (within_fp8_rounding), which a scale misapplied or
# swapped between rows breaks (the first check cannot see a bug the codec and its reference share). And what the
# worker computes from the unquantized states comes exact: target_probs (a compact client's too, from the final
# state that travels in the model dtype), position_mask.


def within_fp8_rounding(got: torch.Tensor, want: torch.Tensor, hidden: int) -> bool:
    """Every element of ``got`` within FP8's rounding of ``want``'s (docs/equality.md): e4m3 keeps 3 mantissa
    bits (2**-4 relative), a subnormal rounds by half a step (2**-10 of its block's scale, amax / 448), and
    the restored value rounds once more to the model dtype (bf16: 2**-8 relative)."""
    x, y = want.double(), got.double()
    blocks = x.unflatten(-1, (-1, hidden))
    scale = (blocks.abs().amax(-1, keepdim=True) / 448).expand_as(blocks).flatten(-2)
    return bool(((y - x).abs() <= x.abs() * (2**-4 + 2**-8) + scale * 2**-10).all())


def _check_fp8(got, engine, batch, kind, **ref) -> None:
    want = colocated_reference(engine, batch, kind, wire_fp8=True, **ref)
    assert mismatch(got, want) is None, mismatch(got, want)
    plain = colocated_reference(engine, batch, kind, **ref)
    hidden = engine.target_info().hidden_size
    for name in FP8_TENSORS:
        if name in got:
            assert not torch.equal(got[name], plain[name])  # it did travel as FP8
            assert within_fp8_rounding(got[name], plain[name], hidden), name
    for name in ("target_probs", "position_mask"):
        if name in got:
            assert torch.equal(got[name], plain[name]), name


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
            _check_fp8(future.result(), engine, batch, "eagle3", shards=2, compact=not plane,
                   selected=tiny_vocab_mapping)
        dspark = sample_batch(tiny_target_dir, 3, 20, seed=5)
        _check_fp8(client.generate_batch(*dspark, kind="dspark"), engine, dspark, "dspark", shards=2)
        stats = client.stats
    assert (stats.fp8_replies, stats.fp8_declined) == (6, 0)
    assert stats.plane_replies == (6 if plane else 0)
    # verify="all": each reply's FP8 bytes and scales, as landed, against the worker's digests of what it sent
    # (and, over frames, the lm_head slice's reply too)
    assert stats.digest_checks == (6 if plane else 7) and stats.digest_mismatches == 0


def test_fp8_batches_whose_shards_come_in_both_formats(mixed, tiny_target_dir, tiny_vocab_mapping, colocated_target):
    """FP8 shards of one batch, full through the plane and compact as frames: each shard's rows are its format's
    colocated FP8 round trip, bit for bit (restored per format, then the compact rows expanded)."""
    engine = colocated_target()
    with RemoteTargetModel(mixed.frontend, service="mixed", num_shards=2, prefetch_depth=2, wire_dtype="fp8",
                           timeout=60) as remote:
        remote.set_vocab_mapping(*tiny_vocab_mapping)
        batches = [sample_batch(tiny_target_dir, 4, 32, seed=40 + seed) for seed in range(4)]
        futures = [remote.generate_batch_async(*batch, kind="eagle3") for batch in batches]
        for batch, future in zip(batches, futures):
            got = future.result()
            forms = [colocated_reference(engine, batch, "eagle3", shards=2, compact=compact, wire_fp8=True,
                                         selected=tiny_vocab_mapping) for compact in (False, True)]
            for rows in (slice(0, 2), slice(2, 4)):
                shard = {k: t[rows] for k, t in got.items()}
                assert any(mismatch(shard, {k: t[rows] for k, t in want.items()}) is None for want in forms)
        stats = remote.stats
    assert stats.fp8_replies == 8 and 0 < stats.compact_replies < 8, stats


def test_a_reply_fp8_cannot_carry_comes_in_the_model_dtype_and_is_counted(cluster, tiny_target_dir,
                                                                          tiny_vocab_mapping):
    """A worker whose forward holds a NaN in a hidden state sends that reply in the model dtype (no scale
    represents a NaN, and FP8 must not hide it); the client takes it, NaN and all, and counts it."""
    start_nan_worker(cluster, tiny_target_dir, 7, "--service", "nan")
    cluster.wait_workers(1, service="nan")
    with RemoteTargetModel(cluster.frontend, service="nan", wire_dtype="fp8", same_host_plane=False,
                           timeout=60) as client:
        client.set_vocab_mapping(*tiny_vocab_mapping)
        ids, attention, loss = sample_batch(tiny_target_dir, 2, 16, seed=3)
        fine = client.generate_batch(ids, attention, loss, kind="dspark")
        broken = client.generate_batch(torch.full_like(ids, 7), attention, loss, kind="dspark")
        stats = client.stats
    assert (stats.fp8_replies, stats.fp8_declined) == (1, 1)
    assert not fine["target_hidden_states"].isnan().any()
    assert broken["target_hidden_states"][0, 0, 0].isnan()
    assert broken["target_hidden_states"].dtype == fine["target_hidden_states"].dtype  # the model's


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fp8_replies_equal_the_colocated_round_trip(tiny_target_dir, tiny_vocab_mapping):
    """A CUDA worker quantizes on its device, a CUDA client restores on its own (frames through its pinned
    slabs; the plane through CUDA IPC): each batch bit-equal to the colocated CUDA forward's round trip, and
    complete when resolved (a trainer may read it on any stream)."""
    from spec_serve.engines.hf import HFTarget

    device = torch.device("cuda:0")
    engine = HFTarget(tiny_target_dir, device=device, dtype="bfloat16")
    engine.set_vocab_mapping(*tiny_vocab_mapping)
    with local_cluster(tiny_target_dir, workers=1, worker_args=("--device", "cuda:0", "--dtype", "bfloat16")) as c:
        for plane in (False, True):
            with RemoteTargetModel(c.frontend, device=device, wire_dtype="fp8", same_host_plane=plane, num_shards=2,
                                   timeout=60) as client:
                client.set_vocab_mapping(*tiny_vocab_mapping)
                for seed, kind in [(0, "eagle3"), (1, "dspark")]:
                    batch = sample_batch(tiny_target_dir, 4, 256, seed=seed)
                    got = client.generate_batch(*batch, kind=kind)
                    assert torch.cuda.current_stream(device).query()
                    _check_fp8(got, engine, tuple(t.to(device) for t in batch), kind, shards=2,
                               compact=kind == "eagle3" and not plane, selected=tiny_vocab_mapping)
                stats = client.stats
            assert (stats.fp8_replies, stats.plane_replies) == (4, 4 if plane else 0), stats
