"""How many math threads a worker runs: its share of this host's cores.

Left alone, every torch process starts one OpenMP thread per core, so several workers (and the
trainer's ranks) on one host oversubscribe the cores and spin against each other. A worker without
``--threads`` (and without ``OMP_NUM_THREADS`` in its environment) takes the cores it may run on
divided by the spec-serve workers running on this host for the same broker, and re-divides as workers
come and go.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from spec_serve.protocol.commands import BACKEND_PORT
from spec_serve.telemetry.logs import event

log = logging.getLogger("spec_serve.worker")

# How often a worker with the default share recounts its neighbours.
RECOUNT_S = 10.0
# A worker's --broker when neither the command line nor the environment names one (tools/cli.py).
DEFAULT_BROKER = f"tcp://127.0.0.1:{BACKEND_PORT}"


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


def _flag(args: list[str], flag: str) -> str | None:
    """The value of ``--flag VALUE`` or ``--flag=VALUE`` in ``args`` (the last one given)."""
    found = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(flag + "="):
            found = arg[len(flag) + 1:]
    return found


def worker_broker(args: list[str], environ: Callable[[], dict[str, str] | None]) -> str | None:
    """The broker a worker process serves, as its command line or environment says: ``--broker``, else
    ``SPEC_SERVE_BROKER``, else the default; None when that cannot be known (another user's process, whose
    environment we may not read, or a --config file we cannot read)."""
    value = _flag(args, "--broker")
    if value is not None:
        return value
    env = environ()
    if env is None:
        return None
    if "SPEC_SERVE_BROKER" in env:
        return env["SPEC_SERVE_BROKER"]
    config = _flag(args, "--config") or env.get("SPEC_SERVE_CONFIG")
    if config is not None:
        return _config_broker(config)
    return DEFAULT_BROKER


def _config_broker(path: str) -> str | None:
    try:
        import yaml

        data = yaml.safe_load(Path(path).read_text())
    except Exception:  # unreadable, not YAML (relative to another process's directory): unknown
        return None
    value = data.get("broker") if isinstance(data, dict) else None
    return str(value) if value is not None else DEFAULT_BROKER


def _environ(entry: Path) -> dict[str, str] | None:
    try:
        raw = (entry / "environ").read_bytes()
    except OSError:  # not ours to read
        return None
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {key: value for key, _, value in pairs}


def local_workers(broker_url: str | None = None, proc: Path = Path("/proc")) -> int:
    """spec-serve workers on this host that serve ``broker_url`` (counting this one), from ``/proc``; every
    worker when ``broker_url`` is None; 1 where /proc is absent. Workers of other brokers (another user's
    cluster on a shared node, say) have cores of their own to share."""
    count = 0
    for entry in proc.glob("[0-9]*") if proc.is_dir() else ():
        try:
            args = [a.decode(errors="replace") for a in (entry / "cmdline").read_bytes().split(b"\0") if a]
        except OSError:  # the process ended, or is not ours to read
            continue
        if not is_worker_cmdline(args):
            continue
        count += broker_url is None or worker_broker(args, functools.partial(_environ, entry)) == broker_url
    return max(1, count)


def default_threads(broker_url: str | None = None) -> int:
    """This worker's share: usable cores over the local workers of its broker, at least 1."""
    return max(1, usable_cores() // local_workers(broker_url))


class ThreadShare:
    """Sets torch's intra-op threads (and ``OMP_NUM_THREADS`` for child processes): ``fixed`` if given,
    else :func:`default_threads` among the workers of ``broker_url``, recounted every ``RECOUNT_S`` by
    :meth:`rebalance`."""

    def __init__(self, fixed: int | None, broker_url: str | None = None):
        if fixed is not None and fixed < 1:
            raise ValueError(f"--threads must be >= 1, got {fixed}")
        self.fixed = fixed
        self.broker_url = broker_url
        self.threads = 0
        self._next_recount = 0.0

    def apply(self) -> int:
        self._set(self.fixed or default_threads(self.broker_url))
        self._next_recount = time.monotonic() + RECOUNT_S
        return self.threads

    def freeze(self, why: str) -> None:
        """Keep the current share from now on (no more recounts), saying ``why`` at INFO once."""
        if self.fixed is None:
            self.fixed = self.threads
            event(log, logging.INFO, "worker.threads_kept", threads=self.threads, reason=why)

    def rebalance(self) -> None:
        """Called between forwards: follow the default share as workers on this host come and go."""
        if self.fixed is not None or time.monotonic() < self._next_recount:
            return
        before = self.threads
        self.apply()
        if self.threads != before:
            event(log, logging.INFO, "worker.threads", threads=self.threads, previous=before,
                  local_workers=local_workers(self.broker_url))

    def _set(self, n: int) -> None:
        self.threads = n
        os.environ["OMP_NUM_THREADS"] = str(n)
        if "torch" in sys.modules:  # else the worker sets it once past its broker check, which needs no torch
            self.set_torch_threads()

    def set_torch_threads(self) -> None:
        """torch's intra-op threads to the share (``OMP_NUM_THREADS`` alone, read as torch loads, would cap it
        at the cores)."""
        import torch

        torch.set_num_threads(self.threads)
