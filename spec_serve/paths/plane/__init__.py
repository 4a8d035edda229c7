"""The same-host plane: a reply's bytes lent through memory both processes map (shared memory, CUDA IPC).
On by default; off with ``RemoteTargetModel(same_host_plane=False)`` or SPEC_SERVE_SAME_HOST_PLANE=0 on
either side. ``samehost.py`` has the slots and their lifetimes, ``shm.py`` the segments, ``cuda_ipc.py``
the CUDA IPC handles; ``worker.py`` and ``client.py`` are the path's two halves."""

from __future__ import annotations

from typing import ClassVar

from spec_serve.paths.base import ClientSetup, ReplyPath, WorkerSetup
from spec_serve.paths.plane import samehost
from spec_serve.paths.plane.client import PlaneClient
from spec_serve.paths.plane.worker import PlaneWorker


class PlanePath(ReplyPath):
    name: ClassVar[str] = "plane"

    @classmethod
    def worker(cls, setup: WorkerSetup) -> PlaneWorker:
        lease = samehost.DEFAULT_LEASE_S if setup.plane_lease is None else setup.plane_lease
        return PlaneWorker(setup.device, setup.plane_slots, lease, setup.copy_stream, setup.faults)

    @classmethod
    def client(cls, setup: ClientSetup) -> PlaneClient:
        return PlaneClient(setup.device, setup.options.get("same_host_plane"), setup.port)
