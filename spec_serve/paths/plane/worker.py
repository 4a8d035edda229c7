"""The worker's side of the same-host plane: a GENERATE reply to a client of this host lent in a slot of
the worker's ``WorkerPlane`` (samehost.py); the data message carries the slot's descriptor and the
safetensors header of its bytes."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

import torch

from spec_serve.paths.base import Delivery, Outgoing, WorkerSide
from spec_serve.paths.faults import Faults
from spec_serve.paths.plane import samehost, shm
from spec_serve.protocol.messages import SupervisionRequest


class PlaneWorker(WorkerSide):
    name: ClassVar[str] = "plane"

    def __init__(self, device: torch.device, slots: int, lease_s: float, copy_stream: torch.cuda.Stream | None,
                 faults: Faults):
        self.device, self.slots, self.lease_s = device, slots, lease_s
        self.copy_stream = copy_stream
        self.faults = faults
        # Made by start() and unlinked by close(): a worker that is built but never run holds no segment.
        self.plane: samehost.WorkerPlane | None = None

    def start(self) -> None:
        self.plane = samehost.WorkerPlane.start(self.device, self.slots, self.lease_s)

    def close(self) -> None:
        plane, self.plane = self.plane, None
        if plane is not None:
            plane.close()

    def before_hard_exit(self) -> None:
        shm.unlink_own_companions()

    def lent_out(self) -> int:
        return self.plane.lent_out() if self.plane is not None else 0

    def takes(self, request: SupervisionRequest) -> bool:
        """A GENERATE request whose offer names this host (anything malformed: no)."""
        return self.plane is not None and request.is_generate and \
            self.plane.transport(request.offer(self.name)) is not None

    def local(self, request: SupervisionRequest) -> bool:
        return True

    def deliver(self, items: Sequence[Delivery]) -> list[Outgoing | None]:
        return [self._lend(item) for item in items]

    def _lend(self, item: Delivery) -> Outgoing | None:
        """The reply lent in a slot; None when none is free or the plane failed (frames then)."""
        plane = self.plane
        export = plane.export(item.request.offer(self.name), item.tensors, self.copy_stream) if plane else None
        if export is None:
            return None
        self.faults.corrupt_lent(export.data, export.ready, item.tensors)
        reply = dataclasses.replace(item.reply, path={self.name: export.descriptor})
        return Outgoing(reply, export.frames, export.descriptor["kind"], export.ready, loan=export,
                        lent_bytes=export.nbytes)
