"""Reused (pinned) host buffers for a worker's GPU outputs: no fresh host allocation per message.

A GPU engine's outputs must land in host memory before ZeroMQ can send them. ``tensor.to("cpu")``
allocates fresh pageable memory every time (a page fault per 4 KiB, and pageable device->host copies
run far slower than pinned ones: BENCHMARKS.md). Instead a worker
copies every output of one forward into one slab taken from a small pool of pinned buffers and hands
views of it to the codec (zero copy). The slab goes back to the pool when libzmq has let go of every
frame that borrows it (``sockets.send_lent``: one tracker over all frames, never the last frame's
alone); a batched forward's slab is shared by several replies and is released after the last. The pool
holds at most ``max_buffers`` slabs, so a client that stops reading bounds the worker's memory:
``acquire`` waits. A pool made with ``copy_host_tensors`` takes CPU outputs too (a CPU worker with
``--host-pool``), so the same lending and reuse runs in CPU tests.

Replies change size from batch to batch (a trainer pads each batch to its longest row), and a new pinned
slab is expensive: pinning hundreds of MB takes a significant fraction of a forward, on the worker's
compute thread. So slabs come in sizes of a ladder (``slab_bytes``: four steps per doubling) and every
new slab is made for the largest reply this pool has seen: once the longest rows came by and the pool
holds its slabs, no reply of any length makes another (BENCHMARKS.md, issue 40).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Hashable, Mapping
from typing import TypeVar

import torch

from spec_serve.telemetry.logs import event

log = logging.getLogger("spec_serve.worker")

_ALIGN = 64
# The smallest slab or receive buffer either pool makes; the ladder below starts here.
MIN_SLAB_BYTES = 4096
# Steps of the size ladder per doubling: a buffer is at most 1/LADDER_STEPS of its next power of two
# larger than what it was made for.
LADDER_STEPS = 4


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def slab_bytes(nbytes: int) -> int:
    """The buffer size made for ``nbytes``: the next step of a ladder of ``LADDER_STEPS`` steps per power of
    two (at least ``MIN_SLAB_BYTES``), so buffers made for one length fit the lengths near it."""
    if nbytes <= MIN_SLAB_BYTES:
        return MIN_SLAB_BYTES
    base = 1 << ((nbytes - 1).bit_length() - 1)  # base < nbytes <= 2 * base
    step = base // LADDER_STEPS
    return base + -(-(nbytes - base) // step) * step


class Lease:
    """One slab lent out; returned to its pool after ``release`` was called ``refs`` times."""

    def __init__(self, pool: HostBufferPool, buffer: torch.Tensor):
        self.pool = pool
        self.buffer = buffer
        self._refs = 1
        self._lock = threading.Lock()

    def retain(self, n: int = 1) -> Lease:
        with self._lock:
            self._refs += n
        return self

    def release(self) -> None:
        with self._lock:
            self._refs -= 1
            last = self._refs == 0
        if last:
            self.pool._give_back(self.buffer)


class HostBufferPool:
    """At most ``max_buffers`` host slabs, pinned when ``pin`` (and CUDA is available).

    ``copy_host_tensors``: ``to_host`` copies outputs that are already on the host into a slab too
    (otherwise it passes them through and only GPU outputs use the pool).
    """

    def __init__(self, max_buffers: int = 4, pin: bool = True, copy_host_tensors: bool = False):
        if max_buffers < 1:
            raise ValueError("max_buffers must be >= 1")
        self.max_buffers = max_buffers
        self.pin = bool(pin) and torch.cuda.is_available()
        self.copy_host_tensors = bool(copy_host_tensors)
        self._free: list[torch.Tensor] = []
        self._lent = 0
        self._cond = threading.Condition()
        self.largest = 0  # the largest request seen: every new slab fits it
        self.allocations = 0  # fresh slabs ever made: flat once the workload's longest rows came by
        self.allocation_seconds = 0.0  # spent making (pinning) them, on the caller's thread
        self.acquisitions = 0

    def acquire(self, nbytes: int, timeout: float | None = None) -> Lease:
        """A slab of at least ``nbytes``; waits while all ``max_buffers`` are lent out."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._lent + len(self._free) < self.max_buffers or self._free,
                                       timeout):
                raise TimeoutError(f"no host buffer came back within {timeout}s")
            self.acquisitions += 1
            self.largest = max(self.largest, nbytes)
            fits = [b for b in self._free if b.numel() >= nbytes]
            if fits:
                buf = min(fits, key=lambda b: b.numel())
                _remove(self._free, buf)
            else:
                if self._lent + len(self._free) >= self.max_buffers:
                    _remove(self._free, min(self._free, key=lambda b: b.numel()))  # too small: replace it
                buf = None
                size = slab_bytes(self.largest)
            self._lent += 1
        if buf is None:
            buf = self._make(size)
        return Lease(self, buf)

    def _make(self, size: int) -> torch.Tensor:
        """A fresh slab of ``size`` bytes (one lent place already counted); said at INFO with its cost."""
        start = time.perf_counter()
        try:
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        except BaseException:
            with self._cond:
                self._lent -= 1
                self._cond.notify()
            raise
        seconds = time.perf_counter() - start
        with self._cond:
            self.allocations += 1
            self.allocation_seconds += seconds
            made = self.allocations
        event(log, logging.INFO, "worker.host_slab_made", bytes=size, pinned=self.pin, seconds=round(seconds, 4),
              slabs_made=made, max_slabs=self.max_buffers)
        return buf

    def _give_back(self, buffer: torch.Tensor) -> None:
        with self._cond:
            self._lent -= 1
            self._free.append(buffer)
            self._cond.notify()

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {"allocations": self.allocations, "acquisitions": self.acquisitions, "lent": self._lent,
                    "free": len(self._free)}


_Key = TypeVar("_Key", bound=Hashable)


def to_host(tensors: Mapping[_Key, torch.Tensor], pool: HostBufferPool | None,
            copy_stream: torch.cuda.Stream | None = None) -> tuple[dict[_Key, torch.Tensor], Lease | None,
                                                                  torch.cuda.Event | None]:
    """Host copies of ``tensors``: views of one pooled slab when any lives on a GPU (or the pool copies
    host tensors too), else unchanged.

    Returns ``(tensors, lease, ready)``; release the lease once the views are no longer read (sent).
    Without ``copy_stream`` the copies are complete on return and ``ready`` is None. With one (a CUDA
    stream on the tensors' device) the copies are queued on it behind the work that produces the
    tensors and this returns at once, so the next forward overlaps this one's device->host copy: read
    the views only once ``ready`` (an event on that stream) has completed.
    """
    if pool is None or (not pool.copy_host_tensors and all(t.device.type == "cpu" for t in tensors.values())):
        return {k: v.to("cpu") for k, v in tensors.items()}, None, None
    if copy_stream is not None and any(t.device not in (copy_stream.device, torch.device("cpu"))
                                       for t in tensors.values()):
        copy_stream = None  # outputs on several GPUs: copy synchronously
    sizes = {k: _aligned(t.numel() * t.element_size()) for k, t in tensors.items()}
    lease = pool.acquire(sum(sizes.values()))
    out, offset, devices = {}, 0, set()
    try:
        with contextlib.ExitStack() as on_stream:
            if copy_stream is not None:
                copy_stream.wait_stream(torch.cuda.current_stream(copy_stream.device))
                on_stream.enter_context(torch.cuda.stream(copy_stream))
            for name, t in tensors.items():
                nbytes = t.numel() * t.element_size()
                dst = lease.buffer[offset : offset + nbytes].view(t.dtype).view(t.shape)
                dst.copy_(t, non_blocking=True)
                if t.device.type == "cuda":
                    devices.add(t.device)
                    if copy_stream is not None:
                        t.record_stream(copy_stream)  # the allocator must not reuse it before the copy ran
                out[name] = dst
                offset += sizes[name]
            if copy_stream is not None:
                ready = torch.cuda.Event()
                ready.record(copy_stream)
                return out, lease, ready
        for device in devices:
            torch.cuda.current_stream(device).synchronize()
    except BaseException:
        lease.release()
        raise
    return out, lease, None


def _remove(buffers: list[torch.Tensor], buf: torch.Tensor) -> None:
    """Remove ``buf`` by identity: ``list.remove`` compares with ``==``, which on tensors is elementwise."""
    buffers[:] = [b for b in buffers if b is not buf]


def _storage_refs(t: torch.Tensor) -> int | None:
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return None
    storage = t.untyped_storage()
    refs: int = use_count(storage._cdata) - 1  # minus the `storage` object made just now
    return refs


# Receive buffers a client keeps: EAGLE-3's five tensors for each batch alive at once with prefetch 2 (the one
# the trainer uses, one landed, one landing), and one to spare.
RECEIVE_BUFFERS = 16
# A new receive buffer is made for the largest request seen of up to this many times its size: one tensor's
# longest rows (a batch's tensors differ in size by more: EAGLE-3's probs are 5x its aux states at the 8B shape).
RECEIVE_BAND = 4


class RecyclingAllocator:
    """``alloc=`` hook for ``wire.decode`` on a receiver: reuse a buffer once nobody holds its tensors.

    A tensor spanning several frames (of 1 MiB) is assembled with one copy into memory from ``alloc``.
    Fresh buffers over 32 MiB come straight from mmap and fault on every 4 KiB page, so that copy, not
    the socket, would dominate the codec path (BENCHMARKS.md, "frames_fresh"). This keeps up to ``max_buffers`` buffers
    and hands out the first ``nbytes`` of the smallest idle one that fits (its storage has no user left: the
    trainer dropped the batch). Tensors change size from batch to batch (rows padded to each batch's longest),
    so a new buffer is made for the largest request of its band seen so far (``RECEIVE_BAND``), on
    ``slab_bytes``'s ladder: once a tensor's longest rows came by, no length allocates again.

    The buffers are pageable, never pinned: a ``non_blocking`` host->device copy the trainer starts
    from one has read it when the call returns (CUDA stages pageable memory), so dropping the batch
    right after cannot let a reuse overwrite bytes a copy still reads. A pinned buffer would need an
    event per copy before reuse.
    """

    def __init__(self, max_buffers: int = RECEIVE_BUFFERS):
        self.max_buffers = max_buffers
        self._buffers: list[torch.Tensor] = []
        self._largest: dict[int, int] = {}  # a request's bit length -> the largest request of that length seen
        self._lock = threading.Lock()
        self.allocations = 0
        self.reuses = 0

    def __call__(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            self._largest[nbytes.bit_length()] = max(self._largest.get(nbytes.bit_length(), 0), nbytes)
            idle = [b for b in self._buffers if _storage_refs(b) == 1]  # only our list holds it
            fits = [b for b in idle if b.numel() >= nbytes]
            if fits:
                self.reuses += 1
                return min(fits, key=lambda b: b.numel())[:nbytes]
            buf = torch.empty(slab_bytes(self._band_largest(nbytes)), dtype=torch.uint8)
            self.allocations += 1
            if _storage_refs(buf) is not None:
                if len(self._buffers) >= self.max_buffers:
                    if not idle:
                        return buf[:nbytes]  # all in use: this one is not pooled
                    _remove(self._buffers, min(idle, key=lambda b: b.numel()))
                self._buffers.append(buf)
            return buf[:nbytes]

    def _band_largest(self, nbytes: int) -> int:
        """The largest request seen from ``nbytes`` to ``RECEIVE_BAND`` times it."""
        bits = nbytes.bit_length()
        return max(n for b in range(bits, bits + RECEIVE_BAND.bit_length())
                   if nbytes <= (n := self._largest.get(b, 0)) <= RECEIVE_BAND * nbytes)
