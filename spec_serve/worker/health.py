"""A worker's own HTTP port (``--http-port``, off by default): ``/health`` for an orchestrator's probes and
``/metrics`` for Prometheus, served by the one HTTP shim the broker uses too (transport/http_shim.py).

The shim starts before the model loads, so a probe sees the worker come up: 503 while it checks its
broker, loads and probes the engine, 200 once the broker answered its READY and it takes requests, 503
again while it is disconnected from the broker or draining after SIGTERM.
"""

from __future__ import annotations

import os
import resource
import time
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from spec_serve.telemetry.metrics import StartupCollector
from spec_serve.transport.http_shim import HttpShim, Query, Response, json_response, metrics_response

if TYPE_CHECKING:
    import torch

    from spec_serve.worker.server import Worker


class WorkerStatus:
    """What the routes read: the start-up ``phase`` until the CLI hands over the ``worker`` (after its probe
    forward passed), then the worker's own state and figures. /metrics has the state and the start time from
    the first second (``StartupCollector``), the worker's figures once it exists."""

    def __init__(self) -> None:
        self.phase = "starting"  # then checking_broker, loading, probing (telemetry.metrics.WORKER_STATES)
        self.worker: Worker | None = None
        self._startup = CollectorRegistry()
        self._startup.register(StartupCollector(lambda: self.phase if self.worker is None else None, time.time()))

    @property
    def state(self) -> str:
        worker = self.worker
        return self.phase if worker is None else worker.state

    def health(self, query: Query) -> Response:
        """200 only while serving; 503 while starting, loading, disconnected, draining or stopping."""
        state = self.state
        body: dict[str, Any] = {"status": "ok" if state == "serving" else "unavailable", "state": state}
        worker = self.worker
        if worker is not None:
            body.update(worker=worker.name, service=worker.service)
        return json_response(200 if state == "serving" else 503, body)

    def metrics(self, query: Query) -> Response:
        worker = self.worker
        return metrics_response(self._startup, *(() if worker is None else (worker.metrics.registry,)))


def start_http(status: WorkerStatus, host: str, port: int, *, authenticated: bool = False,
               insecure_network: bool = False) -> HttpShim:
    """The worker's HTTP shim on ``host:port``, serving ``/health`` and ``/metrics``; beyond loopback only
    for a CURVE worker (``authenticated``) or when told ``insecure_network`` (protected mode)."""
    return HttpShim({"/health": status.health, "/metrics": status.metrics}, host, port, authenticated=authenticated,
                    insecure_network=insecure_network).start()


def device_memory(device: torch.device) -> dict[tuple[str, str], int]:
    """Memory in use, by (device, kind): on a GPU what this process's torch allocated and reserved, and what
    every process uses on it (an engine may run in another); on a CPU this process's resident set."""
    import torch  # the engine's, loaded by then; not at import: /health serves before the broker check

    if device.type == "cuda" and torch.cuda.is_available():
        name = str(device)
        free, total = torch.cuda.mem_get_info(device)
        return {(name, "allocated"): torch.cuda.memory_allocated(device),
                (name, "reserved"): torch.cuda.memory_reserved(device), (name, "used"): total - free}
    return {("cpu", "resident"): _resident_bytes()}


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # no /proc: the peak instead
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
