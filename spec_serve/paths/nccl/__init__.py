"""NCCL: a reply's tensors over a private 2-rank group between a worker and the one client bound to it
(docs/nccl.md; gloo on CPU). ``pairgroup.py`` is the group, ``binding.py`` the client's binding (rendezvous,
pair thread), ``worker.py`` and ``client.py`` the path's two halves."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from spec_serve.paths.base import ClientSetup, ReplyPath, WorkerSetup
from spec_serve.transport.sockets import check_exposure

if TYPE_CHECKING:
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
        from spec_serve.paths.nccl.worker import NcclWorker  # torch.distributed: where a worker is built

        return NcclWorker(setup.name, setup.device, setup.broker_url, setup.advertise_host, setup.security,
                          setup.faults, insecure_network=setup.insecure_network)

    @classmethod
    def client(cls, setup: ClientSetup) -> NcclClient:
        from spec_serve.paths.nccl.binding import ClientBinding
        from spec_serve.paths.nccl.client import NcclClient

        options = setup.options
        if options.get("enable_nccl"):
            _check_rendezvous_exposure(setup.port.local_host, bool(options.get("insecure_network")))
        binding = ClientBinding(setup.port, setup.service, setup.device,
                                float(options.get("nccl_timeout", DEFAULT_TIMEOUT_S)),
                                float(options.get("nccl_retry_s", DEFAULT_RETRY_S))) \
            if options.get("enable_nccl") else None
        return NcclClient(binding, setup.port)


def _check_rendezvous_exposure(local_host: str, insecure_network: bool) -> None:
    """Protected mode: the NCCL rendezvous (gloo/NCCL connections) cannot be authenticated, so it listens
    beyond loopback only when told ``insecure_network`` (or SPEC_SERVE_INSECURE_NETWORK)."""
    check_exposure(local_host, "enable_nccl=True: this client's NCCL rendezvous (gloo/NCCL connections)",
                   authenticated=False, insecure_network=insecure_network,
                   fix="insecure_network=True (env SPEC_SERVE_INSECURE_NETWORK=1), or use frames (enable_nccl=False)")
