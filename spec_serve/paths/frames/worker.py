"""The worker's side of frames: a reply's outputs copied into a pooled host slab (a side CUDA stream on a
GPU, so the next forward starts at once) and encoded as safetensors frames that are views of it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from spec_serve.paths.base import Delivery, Outgoing, WorkerSide
from spec_serve.paths.faults import Faults
from spec_serve.paths.frames.hostpool import HostBufferPool, Lease, to_host
from spec_serve.protocol import wire
from spec_serve.protocol.messages import SupervisionRequest


class SlabShare:
    """One reply's share of a slab: the slab goes back once every reply sharing it has left or was dropped."""

    def __init__(self, lease: Lease):
        self.lease = lease

    def left(self) -> None:
        self.lease.release()

    def dropped(self) -> None:
        self.lease.release()


class FramesWorker(WorkerSide):
    name: ClassVar[str] = "frames"

    def __init__(self, host_pool: HostBufferPool | None, copy_stream: torch.cuda.Stream | None, faults: Faults):
        self.host_pool = host_pool  # None: replies borrow the engine's outputs (a CPU engine without --host-pool)
        self.copy_stream = copy_stream
        self.faults = faults

    def takes(self, request: SupervisionRequest) -> bool:
        return True  # every reply can go as frames: the last path of the order

    def deliver(self, items: Sequence[Delivery]) -> list[Outgoing | None]:
        """Every reply from one slab (a packed forward's replies share it), released once per reply."""
        host, lease, ready = to_host({(i, k): v for i, item in enumerate(items) for k, v in item.tensors.items()},
                                     self.host_pool, self.copy_stream)
        try:
            out: list[Outgoing | None] = []
            for i, item in enumerate(items):
                tensors = {k: host[(i, k)] for k in item.tensors}
                frames = wire.encode(tensors)
                if item.request.is_generate:
                    self.faults.corrupt_frames(frames, ready, tensors)
                out.append(Outgoing(item.reply, frames, self.name, ready,
                                    loan=SlabShare(lease) if lease is not None else None))
            if lease is not None:
                lease.retain(len(items) - 1)  # one release per reply
            return out
        except BaseException:
            if lease is not None:
                lease.release()
            raise
