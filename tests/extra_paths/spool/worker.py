"""The worker's side of spool: a GENERATE reply to a client of this host written into the client's directory.
The worker owns each file until the reply is sent (dropped: deleted); the client deletes what it read, and
the worker's close deletes any it wrote that is still there."""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from spec_serve.paths.base import Delivery, Outgoing, WorkerSide
from spec_serve.protocol import wire
from spec_serve.protocol.messages import SupervisionRequest
from spec_serve.transport.sockets import local_host_key


class SpoolFile:
    """A reply's file: the reply's loan."""

    def __init__(self, path: Path):
        self.path = path

    def left(self) -> None:
        """Sent: the client reads and deletes it."""

    def dropped(self) -> None:
        self.path.unlink(missing_ok=True)


class SpoolWorker(WorkerSide):
    name: ClassVar[str] = "spool"

    def __init__(self) -> None:
        self.host = local_host_key()
        self.written: list[Path] = []
        self._lock = threading.Lock()

    @staticmethod
    def _offer(request: SupervisionRequest) -> dict[str, Any] | None:
        offer = request.offer("spool")
        return offer if isinstance(offer, dict) and isinstance(offer.get("dir"), str) else None

    def takes(self, request: SupervisionRequest) -> bool:
        offer = self._offer(request)
        return request.is_generate and offer is not None and offer.get("host") == self.host and \
            os.path.isdir(offer["dir"])

    def local(self, request: SupervisionRequest) -> bool:
        return True

    def deliver(self, items: Sequence[Delivery]) -> list[Outgoing | None]:
        return [self._write(item) for item in items]

    def _write(self, item: Delivery) -> Outgoing:
        offer = self._offer(item.request)
        assert offer is not None  # takes() said so
        path = Path(offer["dir"]) / f"{item.request_id.hex()}.safetensors"
        frames = wire.encode({k: v.to("cpu") for k, v in item.tensors.items()})
        with open(path, "wb") as f:
            for frame in frames:
                f.write(memoryview(frame))
        with self._lock:
            self.written.append(path)
        nbytes = path.stat().st_size
        reply = dataclasses.replace(item.reply, path={"spool": {"file": path.name, "nbytes": nbytes}})
        return Outgoing(reply, [], self.name, loan=SpoolFile(path), lent_bytes=nbytes)

    def close(self) -> None:
        with self._lock:
            written, self.written = self.written, []
        for path in written:
            path.unlink(missing_ok=True)
