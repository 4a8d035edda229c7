"""Pinned host slabs through which a reply's frames land on the client's GPU.

A host->device copy straight from a ZeroMQ frame reads pageable memory: CUDA stages it through its own
small pinned buffers, chunk by chunk, and the client's GPU context stays busy for the whole copy (several
times longer than a DMA from pinned memory). On a GPU the client shares with a worker, that context time
is taken from the worker's forward. So a reply's bytes bound for a GPU go through ``Staging``: CPU copies
of a tensor's frames, one after another, into a pinned slab until it is full, then one ``non_blocking``
host->device copy of the slab, while the CPU fills the next slab.

Ownership, the invariant every use keeps: a slab is written by the CPU only once the device copy that
last read it has completed (the event recorded after that copy). The slabs form a ring of at most
``slabs``, made on first use; ``land`` takes the oldest and waits for its event when it is still running.
``land`` returns once its own copies completed, so the bytes are on the device when it returns (as with a
pageable copy) and no slab is lent past it. ``close`` (the client closes) drops every slab; a ``land``
after it copies straight from the frames.

Pinned memory can run out (a host's locked-memory limit, a container's). A slab that cannot be pinned is not
an error: the ring works with the slabs it has, and with none, frames land straight from the frames
(pageable copies, as without staging). One WARNING names the reason; ``unpinned`` keeps it.

The pinning, the events and the device copy are injectable, so the reuse rule runs in CPU tests.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch

from spec_serve.client.received import Span
from spec_serve.protocol.wire import TensorSpan
from spec_serve.telemetry.logs import event, one_line

log = logging.getLogger("spec_serve.client")

# Slabs in the ring: the CPU fills one while the device reads the one before; the rest absorb a device
# stream that is still busy with earlier work (the expansion of the previous batch).
STAGING_SLABS = 4
# Bytes a slab holds: the frames of a tensor are gathered into slabfuls, so each device copy moves this much
# however small the frames are.
STAGING_SLAB_BYTES = 16 << 20


class Event(Protocol):
    """What ``Staging`` needs of a CUDA event: recorded after a copy, then polled or waited for."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


# copy(device destination, pinned source): queue the copy, do not wait for it.
DeviceCopy = Callable[[torch.Tensor, torch.Tensor], None]


class _CudaEvent:
    """A CUDA event recorded on the current stream of ``device``."""

    def __init__(self, device: torch.device):
        self._device = device
        self._event = torch.cuda.Event()

    def record(self) -> None:
        self._event.record(torch.cuda.current_stream(self._device))

    def query(self) -> bool:
        return bool(self._event.query())

    def synchronize(self) -> None:
        self._event.synchronize()


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _copy_async(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src, non_blocking=True)


@dataclasses.dataclass
class _Slab:
    buffer: torch.Tensor  # pinned uint8, slab_bytes long
    read_by: Event | None = None  # the device copy that last read it; None: never read


class Staging:
    """At most ``slabs`` pinned slabs of ``slab_bytes``, lent to one landing at a time (any thread).

    ``pin(nbytes)``: a pinned CPU uint8 tensor; ``event()``: an unrecorded ``Event``; ``copy(dst, src)``:
    queue a device copy (defaults: CUDA on ``device``'s current stream).
    """

    def __init__(self, device: torch.device, slabs: int = STAGING_SLABS, slab_bytes: int = STAGING_SLAB_BYTES,
                 pin: Callable[[int], torch.Tensor] = _pinned, event: Callable[[], Event] | None = None,
                 copy: DeviceCopy = _copy_async):
        if slabs < 1 or slab_bytes < 1:
            raise ValueError("staging needs at least one slab of at least one byte")
        self.device = torch.device(device)
        self.max_slabs, self.slab_bytes = slabs, slab_bytes
        self._pin, self._copy = pin, copy
        self._event = event if event is not None else (lambda: _CudaEvent(self.device))
        self._ring: collections.deque[_Slab] = collections.deque()  # oldest use first
        self._lock = threading.Lock()
        self._closed = False
        self.allocations = 0  # slabs ever pinned: at most ``slabs`` until close
        self.copies = 0  # device copies queued from slabs
        self.waits = 0  # times a slab's previous copy had to be waited for before reuse
        self.unpinned: str | None = None  # why pinning a slab failed (then no more are tried)

    def land(self, span: TensorSpan, out: torch.Tensor) -> torch.Tensor:
        """``span.copy_into(out)`` through the slabs (``out``: contiguous uint8 on the device); complete on return."""
        if not (out.dtype == torch.uint8 and out.is_contiguous() and out.numel() == span.nbytes):
            raise ValueError(f"land needs a contiguous uint8 tensor of {span.nbytes} elements")
        with self._lock:
            if self._closed:
                return span.copy_into(out)
            last = None
            done = 0
            for pieces in _slabfuls(span.parts, self.slab_bytes):
                slab = self._take()
                if slab is None:  # no slab and none can be pinned: only possible before the first slabful
                    assert done == 0
                    return span.copy_into(out)
                n = sum(piece.nbytes for piece in pieces)
                last = self._stage(slab, pieces, out[done : done + n])
                done += n
            if last is not None:
                last.synchronize()  # copies on one stream complete in order: this was the last
        return out.view(span.dtype).view(span.shape)

    def _stage(self, slab: _Slab, pieces: list[memoryview], dst: torch.Tensor) -> Event:
        """Copy ``pieces`` (consecutive bytes of ``dst``) into ``slab`` one after another, then queue one device
        copy of them into ``dst``."""
        host = slab.buffer.numpy()
        n = 0
        for piece in pieces:
            np.copyto(host[n : n + piece.nbytes], np.frombuffer(piece, dtype=np.uint8))
            n += piece.nbytes
        self._copy(dst, slab.buffer[:n])
        event = self._event()
        event.record()
        slab.read_by = event
        self._ring.append(slab)
        self.copies += 1
        return event

    def _take(self) -> _Slab | None:
        """A slab no device copy reads any more: a fresh one while the ring is short (and pinning works),
        else the oldest; None when there is no slab and none can be pinned."""
        if self._ring and (self._ring[0].read_by is None or self._ring[0].read_by.query()):
            return self._ring.popleft()
        if len(self._ring) < self.max_slabs and self.unpinned is None:
            try:
                buffer = self._pin(self.slab_bytes)
            except RuntimeError as e:  # torch's error for a failed cudaHostAlloc
                self.unpinned = one_line(e)
                event(log, logging.WARNING, "client.staging_unpinned", slabs=len(self._ring), reason=self.unpinned,
                      effect="frames land through the slabs pinned so far" if self._ring
                      else "frames land through pageable copies")
            else:
                self.allocations += 1
                return _Slab(buffer)
        if not self._ring:
            return None
        slab = self._ring.popleft()
        assert slab.read_by is not None  # in the ring means read by a copy
        self.waits += 1
        slab.read_by.synchronize()
        return slab

    def slabs(self) -> int:
        """Slabs held now."""
        with self._lock:
            return len(self._ring)

    def close(self) -> None:
        """Drop every slab (none is lent: each ``land`` waited for its copies); later landings copy directly."""
        with self._lock:
            self._closed = True
            self._ring.clear()


def _slabfuls(parts: Sequence[memoryview], size: int) -> list[list[memoryview]]:
    """``parts`` (a tensor's bytes, in frames) as groups of consecutive pieces of ``size`` bytes together (the last
    group may hold fewer): a slab's worth each, whatever the frames' size; empty pieces left out."""
    groups: list[list[memoryview]] = [[]]
    room = size
    for part in parts:
        lo = 0
        while lo < part.nbytes:
            if room == 0:
                groups.append([])
                room = size
            piece = part[lo : lo + room]
            groups[-1].append(piece)
            room -= piece.nbytes
            lo += piece.nbytes
    return [g for g in groups if g]


def land(span: Span, out: torch.Tensor, staging: Staging | None) -> torch.Tensor:
    """``span.copy_into(out)``, through ``staging`` when there is one and the bytes are a frame's (bytes a
    worker lent are copied as their path copies them)."""
    if staging is not None and isinstance(span, TensorSpan):
        return staging.land(span, out)
    return span.copy_into(out)
