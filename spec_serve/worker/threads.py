"""How many math threads a worker runs: its share of this host's cores.

Left alone, every torch process starts one OpenMP thread per core, so several workers (and the
trainer's ranks) on one host oversubscribe the cores and spin against each other. A worker without
``--threads`` (and without ``OMP_NUM_THREADS`` in its environment) takes its share of the cores it may
run on: each of them split evenly among the spec-serve workers on this host, for the same broker, that
may run on it too (their CPU affinity). Workers that share every core divide them; workers pinned to
cores of their own (Slurm tasks, taskset, Kubernetes' CPU manager) each keep all of theirs. A CPU quota on
its cgroup (a container's --cpus, a Kubernetes CPU limit) caps the share. It re-divides as workers come
and go.
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


def own_cpus() -> frozenset[int]:
    """The cores this process may run on (its CPU affinity), else all the host has."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity on this OS
        return frozenset(range(os.cpu_count() or 1))


def usable_cores() -> int:
    return max(1, len(own_cpus()))


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


def parse_cpu_list(text: str) -> frozenset[int]:
    """A kernel CPU list (``0-3,8,10-11``, as ``/proc/PID/status`` ``Cpus_allowed_list`` has it) as a set."""
    cpus: set[int] = set()
    for item in text.strip().split(","):
        if item:
            first, _, last = item.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


def _affinity(entry: Path) -> frozenset[int] | None:
    """The CPUs process ``entry`` may run on; None if unknown."""
    try:
        for line in (entry / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return parse_cpu_list(line.partition(":")[2])
    except (OSError, ValueError):
        pass
    return None


def worker_affinities(broker_url: str | None = None,
                      proc: Path = Path("/proc")) -> list[frozenset[int] | None]:
    """The CPU affinity (None: unknown) of each spec-serve worker on this host that serves ``broker_url``
    (this one too), from ``/proc``; of every worker when ``broker_url`` is None. Workers of other brokers
    (another user's cluster on a shared node, say) have cores of their own to share."""
    found = []
    for entry in proc.glob("[0-9]*") if proc.is_dir() else ():
        try:
            args = [a.decode(errors="replace") for a in (entry / "cmdline").read_bytes().split(b"\0") if a]
        except OSError:  # the process ended, or is not ours to read
            continue
        if is_worker_cmdline(args) and (
                broker_url is None or worker_broker(args, functools.partial(_environ, entry)) == broker_url):
            found.append(_affinity(entry))
    return found


def local_workers(broker_url: str | None = None, proc: Path = Path("/proc")) -> int:
    """spec-serve workers on this host that serve ``broker_url`` (counting this one); 1 where /proc is absent."""
    return max(1, len(worker_affinities(broker_url, proc)))


def default_threads(broker_url: str | None = None, proc: Path = Path("/proc"),
                    cpus: frozenset[int] | None = None, cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """This worker's share of ``cpus`` (default: the cores it may run on): each core split evenly among the
    local workers of its broker that may run on it (one whose affinity is unknown counts on all of them;
    this worker counts once), at most its cgroup's CPU quota, at least 1 thread."""
    mine = cpus if cpus is not None else own_cpus()
    sharing = [a if a is not None else mine for a in worker_affinities(broker_url, proc)]
    share = sum(1 / max(1, sum(cpu in a for a in sharing)) for cpu in mine)
    quota = cgroup_cpus(cgroup, proc / "self" / "cgroup")
    return max(1, int(min(share, quota if quota is not None else share) + 1e-9))


def cgroup_cpus(root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPUs this process's cgroup quota allows (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``), the
    smallest along its cgroup's ancestors; None without a quota."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers and "cpu" not in controllers.split(","):
            continue
        base = root / ("" if not controllers else controllers if (root / controllers).is_dir() else "cpu")
        below = [base / Path(*Path(path).parts[1:i]) for i in range(len(Path(path).parts), 0, -1)]
        quotas += [q for q in map(_quota, below) if q is not None]
    return min(quotas) if quotas else None


def _quota(directory: Path) -> float | None:
    """The CPU quota set on one cgroup directory (in CPUs), None if none is set there (or no such file)."""
    try:
        if (directory / "cpu.max").is_file():
            quota, period = (directory / "cpu.max").read_text().split()
        else:
            quota = (directory / "cpu.cfs_quota_us").read_text().strip()
            period = (directory / "cpu.cfs_period_us").read_text().strip()
        return None if quota in ("max", "-1") else int(quota) / int(period)
    except (OSError, ValueError):
        return None


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
