"""NCCL: a reply's tensors over a private 2-rank group between a worker and the one client bound to it
(docs/nccl.md; gloo on CPU). ``pairgroup.py`` is the group, ``binding.py`` the client's binding (rendezvous,
pair thread), ``worker.py`` and ``client.py`` the path's two halves."""

from __future__ import annotations

from typing import ClassVar

from spec_serve.paths.base import ClientSetup, ReplyPath, WorkerSetup
from spec_serve.paths.nccl.binding import ClientBinding
from spec_serve.paths.nccl.client import NcclClient
from spec_serve.paths.nccl.worker import NcclWorker

# RemoteTargetModel's defaults: nccl_timeout bounds the bind, the group's formation and every transfer;
# after a refused or failed bind, frames are used for nccl_retry_s before the next attempt.
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_RETRY_S = 30.0


class NcclPath(ReplyPath):
    name: ClassVar[str] = "nccl"

    @classmethod
    def worker(cls, setup: WorkerSetup) -> NcclWorker:
        return NcclWorker(setup.name, setup.device, setup.broker_url, setup.advertise_host, setup.security,
                          setup.faults, insecure_network=setup.insecure_network)

    @classmethod
    def client(cls, setup: ClientSetup) -> NcclClient:
        options = setup.options
        binding = ClientBinding(setup.port, setup.service, setup.device,
                                float(options.get("nccl_timeout", DEFAULT_TIMEOUT_S)),
                                float(options.get("nccl_retry_s", DEFAULT_RETRY_S))) \
            if options.get("enable_nccl") else None
        return NcclClient(binding, setup.port)
