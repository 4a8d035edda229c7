"""Replies as frames on training rows (issue 40 item 5): a trainer pads each batch to its longest row, so
every reply has another size. What a batch costs the frames path in allocations and waits must stay flat
after warm-up, counted per batch (not timed):

- the worker's host slabs (``HostBufferPool``, pinned on a GPU worker): each new one is pinned on the
  compute thread, and the next forward waits for it. With slabs made to each reply's exact size, new
  longest rows kept making them for the first ~40 batches (the gap of issue 40: 0.72x colocated over 12
  batches, BENCHMARKS.md);
- the client's receive buffers (``RecyclingAllocator``, a CPU client's landing): reused only at the exact
  size, so every batch of new lengths allocated fresh, page-faulting memory;
- the client's pinned staging slabs and the waits for them (``Staging``, a GPU client's landing): fixed
  slabs, flat on the old code too, kept here so a landing that pins per size shows up.

The lengths are the bench's own workload (``spec-serve bench --lengths lognormal``, 4 rows of at most 2048):
what the GPU figures were measured on. Tensors are narrow (the sizes scale with the padded length, which is
what matters); leases are held as libzmq holds them while replies are sent, and batches as a trainer holds
them while the next ones land.
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Callable

import torch

from spec_serve.client.assembly import assemble
from spec_serve.client.received import Received
from spec_serve.client.staging import Staging
from spec_serve.paths.frames.hostpool import HostBufferPool, RecyclingAllocator, slab_bytes, to_host
from spec_serve.protocol import wire
from spec_serve.tools.bench import row_lengths

ROWS, SEQ = 4, 2048
BATCHES, WARM_UP = 60, 20  # a training run's first steps warm up; after those, nothing per batch
# Replies whose slabs libzmq still sends from (a worker of capacity 2: 4 slabs); batches the trainer still
# holds when the next lands (prefetch 2: the one it trains on and the one landed before).
SENDING, HELD = 3, 2


def _padded_lengths() -> list[int]:
    return [max(rows) for rows in row_lengths("lognormal", BATCHES, ROWS, SEQ)]


def _eagle3_like(length: int, seed: int) -> dict[str, torch.Tensor]:
    """The five EAGLE-3 reply tensors of a padded batch, narrow: their sizes change with ``length`` as the
    8B shape's do (aux states and probs per token, a bool mask, int64 ids and loss mask)."""
    gen = torch.Generator().manual_seed(seed)
    return {"aux_hidden_states": torch.randn(ROWS, length, 6, generator=gen).to(torch.bfloat16),
            "target_probs": torch.rand(ROWS, length, 4, generator=gen),
            "position_mask": torch.rand(ROWS, length, generator=gen) > 0.5,
            "input_ids": torch.randint(0, 100, (ROWS, length), generator=gen),
            "loss_mask": torch.randint(0, 2, (ROWS, length), generator=gen)}


def _after_warm_up(per_batch: list[int]) -> list[int]:
    return per_batch[WARM_UP:]


def test_slab_ladder_steps():
    """Four steps per doubling: a slab is at most a quarter of its power of two over what it was made for."""
    assert slab_bytes(1) == slab_bytes(4096) == 4096
    assert [slab_bytes(n) for n in (4097, 5120, 5121, 8192, 8193)] == [5120, 5120, 6144, 8192, 10240]
    for n in (10_000, 123_456_789, 1_250_000_000):
        assert n <= slab_bytes(n) <= n * 1.25


def test_worker_makes_no_host_slab_per_batch_after_warm_up():
    """The worker's side: each batch's outputs copied into a slab of the pool (``to_host``, as
    ``FramesWorker.deliver`` does), the slab lent until the reply was sent, ``SENDING`` batches later."""
    pool = HostBufferPool(max_buffers=4, copy_host_tensors=True)  # a GPU worker's 2 + capacity 2
    sending: collections.deque = collections.deque()
    made = []
    for i, length in enumerate(_padded_lengths()):
        before = pool.allocations
        out, lease, _ = to_host(_eagle3_like(length, i), pool)
        assert lease is not None and out["target_probs"].shape == (ROWS, length, 4)
        sending.append(lease)
        if len(sending) > SENDING:
            sending.popleft().release()
        made.append(pool.allocations - before)
    assert sum(_after_warm_up(made)) == 0, f"host slabs made per batch: {made}"
    assert sum(made) <= pool.max_buffers


def _frames(tensors: dict[str, torch.Tensor]) -> Received:
    return Received(b"", {}, wire.parse(wire.encode(tensors))[0])


def _land_batches(count: Callable[[], int], alloc: RecyclingAllocator | None = None,
                  staging: Staging | None = None) -> list[int]:
    """Each batch's two shards land as frames into one batch (``assemble``, the client on the CPU), which
    the trainer holds until ``HELD`` later batches landed. Returns how much ``count()`` rose per batch."""
    held: collections.deque = collections.deque()
    per_batch = []
    for i, length in enumerate(_padded_lengths()):
        before = count()
        whole = _eagle3_like(length, i)
        futures = [concurrent.futures.Future(), concurrent.futures.Future()]
        out = assemble(futures, [2, 2], torch.device("cpu"), alloc, staging=staging)
        futures[0].set_result(_frames({k: v[:2] for k, v in whole.items()}))
        futures[1].set_result(_frames({k: v[2:] for k, v in whole.items()}))
        batch = out.result(timeout=5)
        for name, t in whole.items():
            assert torch.equal(batch[name], t)
        held.append(batch)
        if len(held) > HELD:
            held.popleft()
        per_batch.append(count() - before)
    return per_batch


def test_cpu_client_allocates_no_receive_buffer_per_batch_after_warm_up():
    """A CPU client's landing: each batch's rows assembled in receive buffers (``RecyclingAllocator``)."""
    alloc = RecyclingAllocator()
    made = _land_batches(lambda: alloc.allocations, alloc=alloc)
    assert sum(_after_warm_up(made)) == 0, f"receive buffers allocated per batch: {made}"


class _DoneEvent:
    """A device copy that completed at once (``Staging``'s event): a slab is never waited for by itself."""

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def test_gpu_client_pins_and_waits_nothing_per_batch_after_warm_up():
    """A GPU client's landing: frames through the pinned staging slabs (here CPU buffers, counted, and
    copies that complete at once). Slabs made and waits for a slab's copy, per batch after warm-up: none."""
    staging = Staging(torch.device("cpu"), pin=lambda n: torch.empty(n, dtype=torch.uint8), event=_DoneEvent,
                      copy=lambda dst, src: dst.copy_(src))
    pinned = _land_batches(lambda: staging.allocations, staging=staging)
    waits = _land_batches(lambda: staging.waits, staging=staging)
    assert sum(_after_warm_up(pinned)) == 0 and staging.allocations <= staging.max_slabs, pinned
    assert sum(waits) == 0, waits
