"""Packed forwards (``--packing``): each row against its own padded forward.

A packing worker drops every request's padding and runs the real tokens of one or several queued
requests as one sequence, attention confined to each row. Each packed row must match the padded
(colocated) forward of its own request within ``packing.TOLERANCE`` at real positions, with
``position_mask`` exact on CPU float32, and padded positions holding what docs/packing.md states.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time

import pytest
import torch
from click.testing import CliRunner

from spec_serve.client.api import RemoteTargetModel
from spec_serve.engines import packing
from spec_serve.protocol import wire
from spec_serve.protocol.commands import Status
from spec_serve.protocol.messages import Release
from spec_serve.tools.launch import local_cluster
from spec_serve.tools.tiny import sample_batch
from spec_serve.worker.server import Job, Worker

KINDS = ("eagle3", "dspark", "eagle3_compact")
FP32 = packing.TOLERANCE[torch.float32]


def _job(batch, kind="eagle3", vocab="v0", op="generate"):
    ids, attn, loss = batch
    payload = wire.encode({"input_ids": ids, "attention_mask": attn, "loss_mask": loss})
    header = {"op": op, "kind": kind, "vocab": vocab, "reply_to": "tcp://127.0.0.1:1"}
    return Job(bytes(16), header, payload, time.monotonic())


def _edge_batch(target_dir):
    """Rows of 1, 0, 5 and 24 tokens in a [4, 24] batch: a lone token, an empty row, a full row."""
    ids, attn, loss = sample_batch(target_dir, 4, 24, seed=9)
    for row, n in enumerate((1, 0, 5, 24)):
        attn[row] = torch.arange(24) < n
        loss[row] = (torch.arange(24) < n) & (torch.arange(24) >= n // 2)
    return ids, attn, loss


def _assert_close(packed, padded, attention_mask, tolerance=FP32):
    report = packing.compare(packed, padded, attention_mask)
    assert report.keys() == padded.keys()
    assert packing.violations(report, tolerance) == [], report
    return report


def test_packed_rows_match_their_own_padded_forward(tiny_target_dir, colocated_target):
    """Requests of different lengths packed together: each row equals its own padded forward (float32,
    CPU) within TOLERANCE; position_mask exactly; padded positions as documented."""
    engine = colocated_target()
    requests = [sample_batch(tiny_target_dir, rows, seq, seed=s)
                for s, (rows, seq) in enumerate(((3, 64), (1, 40), (4, 128)))] + [_edge_batch(tiny_target_dir)]
    draft_vocab = int(engine.vocab_mapping()[0].numel())
    for kind in KINDS:
        for request, packed in zip(requests, engine.generate_packed(requests, kind)):
            padded = engine.generate_batch(*request, kind=kind)
            _assert_close(packed, padded, request[1])
            pad = ~request[1].bool()
            next_pad = torch.ones_like(pad)
            next_pad[:, :-1] = pad[:, 1:]
            hidden = [k for k in packed if k.endswith("hidden_states")]
            assert all(bool((packed[k][pad] == 0).all()) for k in hidden), kind
            if kind == "eagle3":
                assert torch.equal(packed["position_mask"], padded["position_mask"])
                assert not bool(packed["position_mask"][next_pad].any())
                inner = next_pad.clone()
                inner[:, -1] = False  # the contract's last position is the shared eagle3_targets' own
                assert torch.allclose(packed["target_probs"][inner], torch.tensor(1.0 / draft_vocab))
                assert torch.equal(packed["target_probs"][:, -1], padded["target_probs"][:, -1])
            if kind == "eagle3_compact":
                assert not bool(packed["argmax_ids"][next_pad].any())


def test_positions_restart_at_zero_for_every_row(tiny_target_dir, colocated_target):
    """Each packed row's position_ids run 0..n-1, as the row alone has them, and they are what the model is
    given. (On the tiny random target a row with positions running on differs from its padded forward by
    about 1e-5 only: its attention barely depends on positions, so the tolerance cannot tell; this does.)"""
    engine = colocated_target()
    requests = [sample_batch(tiny_target_dir, 3, 24, seed=4), _edge_batch(tiny_target_dir)]
    lengths = [n for _, attn, _ in requests for n in attn.sum(1).tolist()]
    want = torch.cat([torch.arange(n) for n in lengths])[None]
    assert torch.equal(packing.PackedLayout.build(requests).position_ids, want)
    given = []
    hook = engine._base.register_forward_pre_hook(lambda _, args, kwargs: given.append(kwargs["position_ids"]),
                                                  with_kwargs=True)
    try:
        engine.generate_packed(requests, "dspark")
    finally:
        hook.remove()
    assert len(given) == 1 and torch.equal(given[0].cpu(), want)


def test_packed_rows_match_to_float64_rounding(tiny_target_dir, colocated_target):
    """The numeric side of the test above: in float64 each packed row matches its padded forward within
    TOLERANCE[float64] (2^-40, derived in packing.py from the summation order alone). Rotary angles are
    computed in float32 whatever the model's dtype, so a row whose positions do not start at 0 (RoPE is
    relative: only that rounding shows) is off by about 1e-7, 5 orders above the bound; in float32 it hides
    under the kernels' own rounding."""
    engine = colocated_target(dtype=torch.float64)
    requests = [sample_batch(tiny_target_dir, 3, 24, seed=4), sample_batch(tiny_target_dir, 2, 40, seed=5),
                _edge_batch(tiny_target_dir)]
    for kind in KINDS:
        for request, packed in zip(requests, engine.generate_packed(requests, kind)):
            _assert_close(packed, engine.generate_batch(*request, kind=kind), request[1],
                          packing.TOLERANCE[torch.float64])


def test_rows_never_attend_across_rows(tiny_target_dir, colocated_target):
    """The document mask is the whole point: with one segment spanning all rows instead (what
    position_ids alone gave under SDPA, issue 16) every row after the first is far off."""
    engine = colocated_target()
    requests = [sample_batch(tiny_target_dir, 2, 32, seed=s) for s in range(2)]
    layout = packing.PackedLayout.build(requests)
    lengths = [n for _, attn, _ in requests for n in attn.sum(1).tolist()]
    bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()
    assert layout.segments == tuple(zip(bounds[:-1], bounds[1:])) and layout.tokens == sum(lengths)

    def last_hidden(segments):
        return engine._forward(layout.input_ids, engine.aux_layer_ids, position_ids=layout.position_ids,
                               **{packing.SEGMENTS_KWARG: packing.row_bounds(segments)})[0][0]

    rows, bleeding = last_hidden(layout.segments), last_hidden(((0, layout.tokens),))
    first = lengths[0]
    assert torch.equal(rows[:first], bleeding[:first])  # the first row has nothing before it
    assert float((rows[first:] - bleeding[first:]).abs().max()) > 0.1


def test_unpackable_requests_are_named_and_served_padded(tiny_target_dir, tiny_vocab_mapping, colocated_target):
    """Left padding, holes or loss on padding cannot be packed: generate_packed refuses them, and a
    packing worker serves them padded, bit-equal to the colocated forward."""
    engine = colocated_target()
    ids, attn, loss = sample_batch(tiny_target_dir, 2, 16, seed=1)
    assert packing.row_lengths(attn, loss) == attn.sum(1).tolist()
    left = attn.flip(1), loss.flip(1)
    hole = attn.clone()
    hole[0, 3] = 0
    loss_on_pad = loss.clone()
    loss_on_pad[1, -1] = 1
    for bad_attn, bad_loss in (left, (hole, loss), (attn, loss_on_pad)):
        assert packing.row_lengths(bad_attn, bad_loss) is None
        with pytest.raises(ValueError, match="cannot be packed"):
            engine.generate_packed([(ids, bad_attn, bad_loss)])
        worker = Worker(engine, "tcp://127.0.0.1:1", packing=True, max_batch_tokens=4096)
        worker.vocab.put("v0", tiny_vocab_mapping)
        result = worker.serve(_job((ids, bad_attn, bad_loss)))
        assert result.status is Status.OK
        got, want = wire.decode(result.frames), engine.generate_batch(ids, bad_attn, bad_loss)
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_serve_group_packs_and_splits(tiny_target_dir, tiny_vocab_mapping, colocated_target):
    """In-process: the packer's grouping rules (any seq lengths; same kind and vocab; the token budget;
    never past a bind/release), the split, and a bad request not spoiling the others."""
    engine = colocated_target()
    worker = Worker(engine, "tcp://127.0.0.1:1", packing=True, max_batch_tokens=10_000)
    worker.vocab.put("v0", tiny_vocab_mapping)
    batches = [sample_batch(tiny_target_dir, rows, seq, seed=s) for s, (rows, seq) in enumerate(((1, 32), (3, 48),
                                                                                                  (2, 16)))]
    for kind in KINDS:
        group = worker.compute.take_group(collections.deque(_job(b, kind) for b in batches))
        assert len(group) == 3
        for b, result in zip(batches, worker.serve_group(group)):
            assert result.status is Status.OK and result.header["batched"] == 3
            _assert_close(wire.decode(result.frames), engine.generate_batch(*b, kind=kind), b[1])
    # Another kind or vocab: never together; a bind/release ends the scan, order kept.
    control = Job(b"", {"prefix": "p"}, [], time.monotonic(), control="release", message=Release("p"))
    backlog = collections.deque([_job(batches[0]), _job(batches[1], kind="dspark"), _job(batches[2], vocab="other"),
                                 _job(batches[2]), control, _job(batches[1])])
    assert len(worker.compute.take_group(backlog)) == 2
    assert [j.control or j.header["kind"] for j in backlog] == ["dspark", "eagle3", "release", "eagle3"]
    # The budget counts real tokens, not padded ones.
    real = [int(b[1].sum()) for b in batches]
    worker.max_batch_tokens = real[0] + real[1]
    backlog = collections.deque(_job(b) for b in batches)
    assert len(worker.compute.take_group(backlog)) == 2 and len(backlog) == 1
    # A bad request in a group: it alone fails, the others are served.
    worker.max_batch_tokens = 10_000
    bad = (batches[1][0] + 10_000, batches[1][1], batches[1][2])
    results = worker.serve_group([_job(batches[0]), _job(bad), _job(batches[2])])
    assert [r.status for r in results] == [Status.OK, Status.ERROR, Status.OK]


def test_packing_flags_are_checked(tiny_target_dir, colocated_target):
    engine = colocated_target()
    with pytest.raises(ValueError, match="token budget of packed forwards"):
        Worker(engine, "tcp://127.0.0.1:1", max_batch_tokens=4096)

    class NoPacking:  # an engine without a packed forward (vllm, sglang)
        engine, device = "vllm", "cpu"

    with pytest.raises(ValueError, match="packing needs the hf engine"):
        Worker(NoPacking(), "tcp://127.0.0.1:1", packing=True)
    from spec_serve.tools.cli import main

    result = CliRunner().invoke(main, ["worker", "--target", str(tiny_target_dir), "--max-batch-tokens", "64"])
    assert result.exit_code == 2 and "token budget of --packing" in result.output


def test_models_packing_cannot_serve_are_named():
    """A sliding window (or any per-layer mask) would be lost in a packed forward: refused up front."""
    from transformers import AutoModelForCausalLM, MistralConfig

    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, sliding_window=8)
    model = AutoModelForCausalLM.from_config(config)
    assert "sliding" in packing.unsupported_reason(model)
    config.sliding_window = None
    assert packing.unsupported_reason(AutoModelForCausalLM.from_config(config)) is None


def test_concurrent_ranks_pack_within_tolerance(tiny_target_dir, tiny_vocab_mapping, colocated_target):
    """Real broker and worker (--packing): ranks with requests of mixed lengths and kinds in flight share
    packed forwards, and every reply matches the colocated padded forward of that request."""
    engine = colocated_target()
    with local_cluster(tiny_target_dir, workers=1, worker_args=["--packing", "--max-batch-tokens", "2048"]) as cluster:
        def rank(r: int):
            with RemoteTargetModel(cluster.frontend, prefetch_depth=4, timeout=60) as client:
                client.set_vocab_mapping(*tiny_vocab_mapping)
                futures = []
                for step in range(6):
                    kind = KINDS[(r + step) % 2]  # eagle3 and dspark interleaved: only like kinds share
                    batch = sample_batch(tiny_target_dir, 2, 24 + 8 * ((r + step) % 3), seed=100 * r + step)
                    futures.append((kind, batch, client.generate_batch_async(*batch, kind=kind)))
                results = [(kind, batch, f.result()) for kind, batch, f in futures]
                return results, client.stats.batched, client.stats.digest_checks

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            runs = list(pool.map(rank, range(3)))
    for results, _, _ in runs:
        for kind, batch, got in results:
            want = engine.generate_batch(*batch, kind=kind)
            _assert_close(got, want, batch[1])
            if kind == "eagle3":
                assert torch.equal(got["position_mask"], want["position_mask"])
    # 18 requests from 3 ranks with 4 in flight each against one worker: some must have shared a forward,
    # and every reply's bytes were checked against the digests the worker took of its packed outputs.
    assert sum(n for _, n, _ in runs) > 0
    assert sum(checks for _, _, checks in runs) == 18


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_packed_rows_within_bf16_tolerance(tiny_target_dir, tiny_vocab_mapping):
    """On a GPU in bf16 each row's kernels differ (flash attention per row, GEMMs by packed shape): the
    rows must stay within TOLERANCE[bfloat16] of their padded forward; prints what was measured."""
    from spec_serve.engines.hf import HFTarget

    engine = HFTarget(tiny_target_dir, device="cuda:0", dtype="bfloat16")
    engine.set_vocab_mapping(*tiny_vocab_mapping)
    tolerance = packing.TOLERANCE[torch.bfloat16]
    worst: dict = collections.defaultdict(float)
    failed = []
    for seq, rows in ((64, (1, 3, 2)), (512, (1, 4, 3, 8))):
        requests = [sample_batch(tiny_target_dir, n, seq, seed=s) for s, n in enumerate(rows)]
        for kind in KINDS:
            for request, packed in zip(requests, engine.generate_packed(requests, kind)):
                report = packing.compare(packed, engine.generate_batch(*request, kind=kind), request[1].cuda())
                failed += packing.violations(report, tolerance)
                for name, measures in report.items():
                    for measure, value in measures.items():
                        worst[f"{name}.{measure}"] = max(worst[f"{name}.{measure}"], value)
    print("\nGPU packing, bf16, worst per tensor:", {k: f"{v:.3g}" for k, v in sorted(worst.items())})
    assert failed == []
