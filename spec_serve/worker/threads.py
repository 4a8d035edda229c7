"""How many math threads a worker runs: its share of this host's cores.

Left alone, every torch process starts one OpenMP thread per core, so several workers (and the
trainer's ranks) on one host oversubscribe the cores and spin against each other. A worker without
``--threads`` (and without ``OMP_NUM_THREADS`` in its environment) takes the cores it may run on
divided by the spec-serve workers running on this host, and re-divides as workers come and go.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from spec_serve.telemetry.logs import event

log = logging.getLogger("spec_serve.worker")

# How often a worker with the default share recounts its neighbours.
RECOUNT_S = 10.0


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), else all the host has."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no sched_getaffinity on this OS
        return max(1, os.cpu_count() or 1)


def is_worker_cmdline(args: list[str]) -> bool:
    """Does a process's argv run ``spec-serve worker`` (the console script or ``-m spec_serve.tools.cli``)?"""
    for i, arg in enumerate(args[:-1]):
        if (arg.endswith("/spec-serve") or arg in ("spec-serve", "spec_serve.tools.cli")) and args[i + 1] == "worker":
            return True
    return False


def local_workers(proc: Path = Path("/proc")) -> int:
    """spec-serve workers running on this host (counting this one), from ``/proc``; 1 where it is absent."""
    count = 0
    for entry in proc.glob("[0-9]*/cmdline") if proc.is_dir() else ():
        try:
            args = entry.read_bytes().split(b"\0")
        except OSError:  # the process ended, or is not ours to read
            continue
        count += is_worker_cmdline([a.decode(errors="replace") for a in args if a])
    return max(1, count)


def default_threads() -> int:
    """This worker's share: usable cores over local workers, at least 1."""
    return max(1, usable_cores() // local_workers())


class ThreadShare:
    """Sets torch's intra-op threads (and ``OMP_NUM_THREADS`` for child processes): ``fixed`` if given,
    else :func:`default_threads`, recounted every ``RECOUNT_S`` by :meth:`rebalance`."""

    def __init__(self, fixed: int | None):
        if fixed is not None and fixed < 1:
            raise ValueError(f"--threads must be >= 1, got {fixed}")
        self.fixed = fixed
        self.threads = 0
        self._next_recount = 0.0

    def apply(self) -> int:
        self._set(self.fixed or default_threads())
        self._next_recount = time.monotonic() + RECOUNT_S
        return self.threads

    def rebalance(self) -> None:
        """Called between forwards: follow the default share as workers on this host come and go."""
        if self.fixed is not None or time.monotonic() < self._next_recount:
            return
        before = self.threads
        self.apply()
        if self.threads != before:
            event(log, logging.INFO, "worker.threads", threads=self.threads, previous=before,
                  local_workers=local_workers())

    def _set(self, n: int) -> None:
        self.threads = n
        os.environ["OMP_NUM_THREADS"] = str(n)
        torch.set_num_threads(n)
