"""Frames landing on a GPU through pinned slabs (spec_serve/client/staging.py): a slab is written again
only once the device copy that read it completed; the ring is bounded; it is dropped on close.

No GPU here: the device is a fake stream whose copies run only when an event after them is waited for
(a DMA engine that runs late), so a slab overwritten before its copy ran lands the wrong bytes. The
``gpu`` test lands real replies through the real pinned slabs, against the colocated forward.
"""

from __future__ import annotations

import concurrent.futures
import functools

import pytest
import torch

from spec_serve.client import api as client_api
from spec_serve.client.api import RemoteTargetModel
from spec_serve.client.assembly import assemble
from spec_serve.client.received import Received
from spec_serve.client.staging import Staging, land
from spec_serve.protocol import wire
from spec_serve.supervision.eagle3 import eagle3_targets


class LateStream:
    """A device stream: copies are queued, and run (reading their slab then) only when waited for."""

    def __init__(self, eager: bool = False):
        self.eager = eager  # run each copy at once: a device that is never behind
        self.queued: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.ran = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.queued.append((dst, src))
        if self.eager:
            self.run_until(len(self.queued))

    def run_until(self, n: int) -> None:
        while self.ran < n:
            dst, src = self.queued[self.ran]
            dst.copy_(src)
            self.ran += 1

    def event(self) -> LateEvent:
        return LateEvent(self)


class LateEvent:
    def __init__(self, stream: LateStream):
        self.stream, self.at = stream, None

    def record(self) -> None:
        self.at = len(self.stream.queued)

    def query(self) -> bool:
        assert self.at is not None
        return self.stream.ran >= self.at

    def synchronize(self) -> None:
        assert self.at is not None
        self.stream.run_until(self.at)


class Pins:
    """The injected pinning: plain CPU buffers, counted."""

    def __init__(self):
        self.made: list[torch.Tensor] = []

    def __call__(self, nbytes: int) -> torch.Tensor:
        self.made.append(torch.empty(nbytes, dtype=torch.uint8))
        return self.made[-1]


def _staging(stream: LateStream, pins: Pins, slabs: int = 2, slab_bytes: int = 64) -> Staging:
    return Staging(torch.device("cpu"), slabs=slabs, slab_bytes=slab_bytes, pin=pins, event=stream.event,
                   copy=stream.copy)


def _span(seed: int, cuts: tuple[int, ...] = (300, 301), n: int = 1000) -> tuple[wire.TensorSpan, torch.Tensor]:
    """A uint8 tensor of ``n`` random bytes received as frames cut at ``cuts``."""
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    raw = memoryview(data.numpy().tobytes())
    bounds = (0, *cuts, n)
    return wire.TensorSpan(torch.uint8, (n,), tuple(raw[a:b] for a, b in zip(bounds, bounds[1:]))), data


def test_a_slab_is_written_again_only_after_its_copy_completed():
    """Two slabs of 64 bytes for 1000 bytes in three frames: every slab is reused many times while the
    device lags; a reuse that did not wait for the copy reading it would land another piece's bytes."""
    stream, pins = LateStream(), Pins()
    staging = _staging(stream, pins)
    span, data = _span(0)
    out = torch.zeros(1000, dtype=torch.uint8)
    got = staging.land(span, out)
    assert torch.equal(got, data)
    assert len(pins.made) == 2 == staging.allocations  # bounded: the ring never grows past its slabs
    assert staging.copies == 16  # 1000 bytes in slabfuls of 64, across the frames' cuts at 300 and 301
    assert staging.waits == staging.copies - 2  # the device never caught up by itself: each reuse waited
    assert stream.ran == len(stream.queued)  # complete on return


def test_frames_smaller_than_a_slab_are_gathered_into_one_device_copy():
    """1000 bytes in frames of 100 (and one odd cut) through slabs of 512: two device copies, each of a full slab
    but the last, every byte where it belongs while the device lags behind."""
    stream, pins = LateStream(), Pins()
    staging = _staging(stream, pins, slabs=2, slab_bytes=512)
    span, data = _span(5, cuts=(100, 200, 300, 333, 400, 500, 600, 700, 800, 900))
    assert torch.equal(staging.land(span, torch.zeros(1000, dtype=torch.uint8)), data)
    assert staging.copies == 2 and [len(q[1]) for q in stream.queued] == [512, 488]


def test_a_slab_whose_copy_completed_is_reused_without_waiting():
    stream, pins = LateStream(eager=True), Pins()
    staging = _staging(stream, pins)
    span, data = _span(1)
    assert torch.equal(staging.land(span, torch.zeros(1000, dtype=torch.uint8)), data)
    assert len(pins.made) == 1 and staging.waits == 0  # the one slab, free each time: nothing more pinned


def test_slabs_are_kept_across_landings_and_dropped_on_close():
    stream, pins = LateStream(), Pins()
    staging = _staging(stream, pins, slabs=3)
    for seed in range(4):
        span, data = _span(seed, cuts=(10 * seed + 1,))
        assert torch.equal(staging.land(span, torch.zeros(1000, dtype=torch.uint8)), data)
    assert len(pins.made) == 3 and staging.slabs() == 3  # pinned once, recycled by every later landing
    staging.close()
    assert staging.slabs() == 0
    copies = staging.copies
    span, data = _span(9)
    assert torch.equal(staging.land(span, torch.zeros(1000, dtype=torch.uint8)), data)  # straight from the frames
    assert staging.copies == copies and len(pins.made) == 3


class FailingPins(Pins):
    """Pinning that works ``works`` times, then fails as cudaHostAlloc does when locked memory runs out."""

    def __init__(self, works: int):
        super().__init__()
        self.works, self.tried = works, 0

    def __call__(self, nbytes: int) -> torch.Tensor:
        self.tried += 1
        if len(self.made) >= self.works:
            raise RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be reported asynchronously")
        return super().__call__(nbytes)


@pytest.mark.parametrize("works", [0, 1])
def test_landing_goes_on_when_pinned_memory_runs_out(works, caplog):
    """No pinned memory (``works=0``): frames land straight from the frames; some (1 of 3 slabs): the ring
    works with that one, its reuse waiting for its copy. Either way every byte lands, pinning is not tried
    again, and one WARNING names the cause."""
    stream, pins = LateStream(), FailingPins(works)
    staging = _staging(stream, pins, slabs=3)
    for seed in range(3):
        span, data = _span(seed)
        assert torch.equal(staging.land(span, torch.zeros(1000, dtype=torch.uint8)), data)
    assert staging.allocations == works == staging.slabs() and pins.tried == works + 1
    assert staging.unpinned == "RuntimeError: CUDA error: out of memory CUDA kernel errors might be reported " \
                               "asynchronously"
    assert staging.copies == (3 * 16 if works else 0) and stream.ran == len(stream.queued)
    warnings = [r.getMessage() for r in caplog.records if "client.staging_unpinned" in r.getMessage()]
    assert len(warnings) == 1 and "out of memory" in warnings[0], warnings
    assert ("pageable copies" in warnings[0]) == (works == 0), warnings


def test_landing_checks_its_destination():
    staging = _staging(LateStream(), Pins())
    span, _ = _span(2)
    with pytest.raises(ValueError, match="contiguous uint8 tensor of 1000"):
        staging.land(span, torch.zeros(999, dtype=torch.uint8))


def test_only_frames_go_through_the_slabs():
    """A tensor that came over a pair group is not a span; without staging a span copies itself."""
    stream, pins = LateStream(), Pins()
    staging = _staging(stream, pins)
    span, data = _span(3)
    assert torch.equal(land(span, torch.zeros(1000, dtype=torch.uint8), None), data)
    assert staging.copies == 0 and not pins.made


def test_assembled_shards_land_through_the_slabs():
    """Both ways a reply lands (a batch of one shard, rows of a sharded batch) go through the staging."""
    gen = torch.Generator().manual_seed(4)
    parts = [{"x": torch.randn(1, 40, generator=gen), "m": torch.rand(1, 3, generator=gen) > 0.5} for _ in range(2)]
    stream, pins = LateStream(), Pins()
    staging = _staging(stream, pins, slab_bytes=48)
    futures = [concurrent.futures.Future() for _ in parts]
    out = assemble(futures, [1, 1], torch.device("cpu"), None, staging=staging)
    for future, part in zip(futures, parts):
        future.set_result(Received(b"", {}, wire.parse(wire.encode(part))[0]))
    got = out.result(timeout=5)
    for name in parts[0]:
        assert torch.equal(got[name], torch.cat([p[name] for p in parts]))
    assert staging.copies == 2 * (4 + 1)  # per shard: 160 bytes in 48-byte pieces, and the mask


def test_eagle3_targets_equal_the_padded_softmax_bit_for_bit():
    """The probs are written without a padded copy of the logits: the same values as softmax of the
    logits concatenated with a zero row, in float32."""
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(3, 9, 50, generator=gen) * 4).to(torch.bfloat16)
    argmax = torch.randint(0, 80, (3, 10), generator=gen)
    probs, _ = eagle3_targets(logits, argmax, torch.rand(80, generator=gen) > 0.5, torch.ones(3, 10))
    padded = torch.cat([logits, logits.new_zeros(3, 1, 50)], dim=1)
    assert torch.equal(probs, torch.softmax(padded.float(), dim=-1))


# --- GPU ------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_frames_land_through_recycled_pinned_slabs(monkeypatch, tiny_target_dir, tiny_vocab_mapping):
    """A GPU client fed frames (the same-host plane off: a worker on another host) lands full and
    compact="auto" replies through two pinned slabs of 64 KiB, reused many times, each batch bit-equal
    to the colocated forward (compact ones expanded as the client does)."""
    from cluster_util import CLIENT_KW, assert_equal_batches
    from spec_serve.engines.hf import HFTarget
    from spec_serve.tools.launch import local_cluster
    from spec_serve.tools.tiny import sample_batch
    from spec_serve.tools.verify import colocated_reference

    monkeypatch.setattr(client_api, "Staging", functools.partial(Staging, slabs=2, slab_bytes=1 << 16))
    device = torch.device("cuda:0")
    colocated = HFTarget(tiny_target_dir, device=device, dtype="bfloat16")
    colocated.set_vocab_mapping(*tiny_vocab_mapping)
    worker = ("--device", "cuda:0", "--dtype", "bfloat16")
    with local_cluster(tiny_target_dir, workers=1, worker_args=worker, env={"SPEC_SERVE_SAME_HOST_PLANE": "0"}) as c:
        for compact in (False, "auto"):
            with RemoteTargetModel(c.frontend, device=device, compact=compact, num_shards=2, same_host_plane=False,
                                   timeout=60, **CLIENT_KW) as client:
                client.set_vocab_mapping(*tiny_vocab_mapping)
                for seed in range(3):
                    batch = sample_batch(tiny_target_dir, 8, 256, seed=seed)
                    got = client.generate_batch(*batch, kind="eagle3")
                    want = colocated_reference(colocated, batch, "eagle3", shards=2, compact=bool(compact),
                                               device=device, selected=tiny_vocab_mapping)
                    assert_equal_batches(got, want)
                assert client.stats.compact_replies == (6 if compact else 0)  # auto over frames: compact
                staging = client._staging
                assert staging is not None and client.stats.replies["frames"] >= 6
                # Bounded by the ring (2 here) and recycled: on an H200 each copy had completed before the next
                # fill, so one slab served them all (the first GPU run pinned 1, not the 2 this once asserted).
                assert 1 <= staging.allocations <= 2 and staging.copies > 10 * staging.allocations
            assert staging.slabs() == 0  # dropped on close
