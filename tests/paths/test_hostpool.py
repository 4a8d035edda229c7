"""Buffer pools: reuse, and removal by identity (``list.remove`` on tensors compares elementwise)."""

import torch

from spec_serve.paths.frames.hostpool import HostBufferPool, RecyclingAllocator, slab_bytes, to_host


def test_recycling_allocator_replaces_an_idle_buffer_when_full():
    alloc = RecyclingAllocator(max_buffers=2)
    # Decoded tensors are views of the buffer (as wire.decode makes them): they keep it in use.
    held = [alloc(10_000).view(-1), alloc(20_000).view(-1)]
    unpooled = alloc(30_000)  # every pooled buffer is in use: handed out, not pooled
    assert all(unpooled.data_ptr() != b.data_ptr() for b in alloc._buffers)
    del held
    fresh = alloc(400_000)  # the pool is full of idle buffers, none large enough: the smallest is replaced
    assert sorted(b.numel() for b in alloc._buffers) == [20_480, 458_752]
    assert any(fresh.data_ptr() == b.data_ptr() for b in alloc._buffers) and fresh.numel() == 400_000
    del fresh
    view = alloc(300_000).view(torch.int32)  # idle and large enough: its first 300,000 bytes, not reallocated
    assert view.numel() == 75_000 and alloc.allocations == 4 and alloc.reuses == 1


def test_recycling_allocator_makes_buffers_for_the_largest_of_their_band():
    """A new buffer is made for the largest request seen of up to 4x its size (one tensor's longest rows), so
    the shorter lengths reuse it later; a much smaller tensor gets a buffer of its own size."""
    alloc = RecyclingAllocator(max_buffers=4)
    longest = alloc(300_000)
    shorter = alloc(100_000)  # the longest's buffer is in use: a new one, made for 300,000
    other = alloc(1_000)  # over 4x smaller than anything seen: its own size
    sizes = [t.untyped_storage().nbytes() for t in (longest, shorter, other)]
    assert sizes == [slab_bytes(300_000)] * 2 + [slab_bytes(1_000)] and shorter.numel() == 100_000


def test_host_pool_reuses_and_replaces_slabs():
    pool = HostBufferPool(max_buffers=2)
    small, big = pool.acquire(10), pool.acquire(1000)
    small.release()
    big.release()
    lease = pool.acquire(500)  # the big slab fits; taken by identity from the free list
    assert pool.stats()["allocations"] == 2
    lease.release()
    bigger = pool.acquire(1 << 20)  # nothing fits and the pool is full: the smallest slab is replaced
    assert pool.stats()["allocations"] == 3 and pool.stats()["free"] == 1
    bigger.release()


def test_to_host_pools_cpu_outputs_only_when_asked():
    tensors = {"a": torch.arange(6, dtype=torch.float32).view(2, 3), "m": torch.tensor([True, False])}
    out, lease, ready = to_host(tensors, HostBufferPool(max_buffers=1))
    assert lease is None and ready is None and out["a"] is tensors["a"]  # a CPU engine's outputs pass through
    pool = HostBufferPool(max_buffers=1, copy_host_tensors=True)  # a CPU worker with --host-pool
    out, lease, ready = to_host(tensors, pool)
    assert lease is not None and ready is None and pool.stats()["lent"] == 1
    start, end = lease.buffer.data_ptr(), lease.buffer.data_ptr() + lease.buffer.numel()
    for name, t in tensors.items():  # equal copies, inside the lent slab
        assert torch.equal(out[name], t) and start <= out[name].data_ptr() < end
    lease.release()
    assert pool.stats() == {"allocations": 1, "acquisitions": 1, "lent": 0, "free": 1}
