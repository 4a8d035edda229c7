"""The client's reply assembly: shards copied straight into rows of one batch, and clear errors.

Cluster tests cover the end to end path (``torch.equal`` to colocated, 1 and 2 shards); these pin
down what they cannot reach: shards arriving out of order, multi-frame tensors, NCCL-style device
tensors mixed in, shards that do not fit together, and shards in both EAGLE-3 formats.
"""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from spec_serve.client.assembly import assemble
from spec_serve.client.compact import Expansion
from spec_serve.client.errors import RemoteError
from spec_serve.client.received import Received
from spec_serve.client.restore import Restoration
from spec_serve.paths.frames.hostpool import RecyclingAllocator
from spec_serve.protocol import wire
from spec_serve.protocol.messages import Reply
from spec_serve.supervision import fp8
from spec_serve.supervision.contract import FP8_TENSORS
from spec_serve.supervision.eagle3 import expand_compact, lm_head_slice
from spec_serve.tools.tiny import sample_batch
from spec_serve.tools.verify import sharded_forward


def _reply(tensors: dict[str, torch.Tensor]) -> Received:
    return Received(b"", {}, wire.parse(wire.encode(tensors))[0])


def _batch(rows: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        # 1 x 1100 x 4096 float32 spans several frames (of 1 MiB): the multi-part copy path.
        "big": torch.randn(rows, 1100, 4096, generator=gen),
        "mask": torch.rand(rows, 7, 1, generator=gen) > 0.5,
        "ids": torch.randint(0, 100, (rows, 7), generator=gen),
    }


def test_shards_arriving_out_of_order_fill_their_rows():
    parts = [_batch(1, 0), _batch(2, 1), _batch(1, 2)]
    futures = [concurrent.futures.Future() for _ in parts]
    out = assemble(futures, [1, 2, 1], torch.device("cpu"), RecyclingAllocator())
    for k in (2, 0, 1):
        assert not out.done()
        futures[k].set_result(_reply(parts[k]))
    got = out.result(timeout=5)
    for name in parts[0]:
        assert torch.equal(got[name], torch.cat([p[name] for p in parts]))
        assert got[name].dtype == parts[0][name].dtype


def test_single_shard_keeps_single_frame_tensors_as_views():
    batch = {"small": torch.arange(6.0).view(2, 3)}
    future = concurrent.futures.Future()
    out = assemble([future], [2], torch.device("cpu"), RecyclingAllocator())
    reply = _reply(batch)
    future.set_result(reply)
    got = out.result(timeout=5)["small"]
    assert torch.equal(got, batch["small"])
    assert got.data_ptr() == torch.frombuffer(reply.tensors["small"].parts[0], dtype=torch.uint8).data_ptr()


def test_device_tensor_shards_mix_with_frame_shards():
    """A shard that came over the pair group (tensors, not spans) merges like any other."""
    parts = [_batch(1, 3), _batch(1, 4)]
    futures = [concurrent.futures.Future() for _ in parts]
    out = assemble(futures, [1, 1], torch.device("cpu"), RecyclingAllocator())
    futures[0].set_result(Received(b"", {}, parts[0]))
    futures[1].set_result(_reply(parts[1]))
    got = out.result(timeout=5)
    assert all(torch.equal(got[n], torch.cat([p[n] for p in parts])) for n in parts[0])


@pytest.mark.parametrize("bad", [
    {"big": torch.zeros(1, 1100, 4096, dtype=torch.float64)},  # dtype
    {"big": torch.zeros(1, 1100, 8)},  # trailing shape
    {"big": torch.zeros(2, 1100, 4096)},  # more rows than the shard sent
    {"other": torch.zeros(1, 1100, 4096)},  # names
])
def test_mismatched_shard_fails_the_batch(bad):
    good = _batch(1, 5)
    futures = [concurrent.futures.Future(), concurrent.futures.Future()]
    out = assemble(futures, [1, 1], torch.device("cpu"), RecyclingAllocator())
    futures[0].set_result(_reply(good))
    futures[1].set_result(_reply({**{k: v for k, v in good.items() if k != "big"}, **bad}))
    with pytest.raises(RemoteError):
        out.result(timeout=5)


def test_failed_shard_fails_the_batch_once():
    futures = [concurrent.futures.Future(), concurrent.futures.Future()]
    out = assemble(futures, [1, 1], torch.device("cpu"), RecyclingAllocator())
    futures[1].set_exception(TimeoutError("worker gone"))
    futures[0].set_result(_reply(_batch(1, 6)))  # arrives after the failure: ignored
    with pytest.raises(TimeoutError, match="worker gone"):
        out.result(timeout=5)


def test_shards_in_both_formats_make_one_eagle3_batch(tiny_target_dir, tiny_vocab_mapping, colocated_target):
    """compact="auto": a worker may answer one shard full and another compact. The compact rows are expanded
    over the whole batch's shape and the full rows taken as they came: each row bit-equal to its own
    reference (the full shard's forward; the colocated compact batch expanded)."""
    engine = colocated_target()
    batch = sample_batch(tiny_target_dir, 4, 24, seed=3)
    full = sharded_forward(engine, batch, "eagle3", shards=2)
    compact = sharded_forward(engine, batch, "eagle3_compact", shards=2)
    weight = lm_head_slice(engine.get_output_embeddings().weight, tiny_vocab_mapping[0])
    expanded = expand_compact({k: v.clone() for k, v in compact.items()}, weight, tiny_vocab_mapping[1])
    executor = concurrent.futures.ThreadPoolExecutor(1)
    expansion = Expansion(lambda: weight, tiny_vocab_mapping[1], torch.device("cpu"), executor)
    for first in ("eagle3", "eagle3_compact"):  # the full shard first, then the compact one first
        futures = [concurrent.futures.Future(), concurrent.futures.Future()]
        out = assemble(futures, [2, 2], torch.device("cpu"), RecyclingAllocator(), asked="eagle3", expand=expansion)
        kinds = [first, "eagle3_compact" if first == "eagle3" else "eagle3"]
        for k in (1, 0):
            source = full if kinds[k] == "eagle3" else compact
            rows = {name: t[2 * k : 2 * k + 2].contiguous() for name, t in source.items()}
            futures[k].set_result(Received(b"", Reply(worker="w", kind=kinds[k]), wire.parse(wire.encode(rows))[0]))
        got = out.result(timeout=30)
        assert sorted(got) == sorted(full)
        for k in (0, 1):
            want = full if kinds[k] == "eagle3" else expanded
            for name in full:
                assert torch.equal(got[name][2 * k : 2 * k + 2], want[name][2 * k : 2 * k + 2]), (first, k, name)
    executor.shutdown()


def test_shards_in_two_formats_without_an_expansion_fail_clearly():
    futures = [concurrent.futures.Future(), concurrent.futures.Future()]
    out = assemble(futures, [1, 1], torch.device("cpu"), RecyclingAllocator(), asked="eagle3")
    futures[0].set_result(Received(b"", Reply(worker="w", kind="eagle3"), wire.parse(wire.encode(_batch(1, 7)))[0]))
    futures[1].set_result(Received(b"", Reply(worker="w", kind="eagle3_compact"),
                                   wire.parse(wire.encode(_batch(1, 8)))[0]))
    with pytest.raises(RemoteError, match="different kinds"):
        out.result(timeout=5)


def test_a_batch_of_fp8_and_model_dtype_shards_restores_each_row_as_its_shard_sent_it():
    """wire_dtype="fp8": shard 0 came FP8 (restored after landing), shard 1 from a worker that cannot send it
    (taken as it came), in either order."""
    hidden = 64
    x = torch.randn(4, 5, 3 * hidden).bfloat16()
    sent = fp8.quantize_reply({"aux_hidden_states": x[:2].clone(), "ids": torch.arange(10).view(2, 5)},
                              FP8_TENSORS, hidden)
    plain = {"aux_hidden_states": x[2:].clone(), "ids": torch.arange(10, 20).view(2, 5)}
    executor = concurrent.futures.ThreadPoolExecutor(1)
    restore = Restoration(torch.bfloat16, torch.device("cpu"), executor)
    for order in ((0, 1), (1, 0)):
        futures = [concurrent.futures.Future(), concurrent.futures.Future()]
        out = assemble(futures, [2, 2], torch.device("cpu"), RecyclingAllocator(), asked="dspark", restore=restore)
        for k in order:
            tensors, wire_dtype = (sent, "fp8") if k == 0 else (plain, None)
            futures[k].set_result(Received(b"", Reply(worker="w", wire_dtype=wire_dtype),
                                           wire.parse(wire.encode(tensors))[0]))
        got = out.result(timeout=30)
        assert sorted(got) == ["aux_hidden_states", "ids"] and got["aux_hidden_states"].dtype == torch.bfloat16
        assert torch.equal(got["aux_hidden_states"][:2], fp8.restore_reply(sent, torch.bfloat16)["aux_hidden_states"])
        assert torch.equal(got["aux_hidden_states"][2:], x[2:]) and torch.equal(got["ids"], torch.arange(20).view(4, 5))
    executor.shutdown()
