"""Stopping a worker the way orchestrators do: SIGTERM (Kubernetes, Slurm, systemd) or SIGINT (Ctrl-C).

The first signal starts a drain: the worker sends LEAVE with ``drain`` at once (the broker sends it
nothing more), hands back the requests it has not started (DONE ``returned``: the broker gives them to
another worker at once), finishes the forward it runs and delivers the replies it owes, waits for
same-host clients to give back the slots they were lent, then leaves for good (LEAVE), releases its
shared memory, CUDA IPC handles and NCCL pair, and exits 0. ``--drain-timeout`` bounds all of it; when
it runs out, or on a second signal, the worker leaves at once: the broker gives what it still held to
other workers, and a forward still running is abandoned (docs/deploy.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
from typing import Protocol

from spec_serve.paths.plane import shm
from spec_serve.telemetry.logs import event

log = logging.getLogger("spec_serve.worker")

# Kubernetes' default terminationGracePeriodSeconds: a drain that fits it ends before SIGKILL.
DEFAULT_DRAIN_TIMEOUT_S = 30.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclasses.dataclass
class Drain:
    """One worker's drain: asked for (``reason``), begun (``deadline``), and how it ended."""

    timeout: float
    reason: str | None = None  # set by request(): a signal handler or another thread may call it
    deadline: float = 0.0
    started: bool = False
    handed_back: int = 0
    outcome: str | None = None  # "drained", or why it ended before
    left: bool = False  # the final LEAVE is sent
    confirmed: bool = False  # the broker answered after handling it

    def request(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason

    def start(self, now: float) -> None:
        self.started, self.deadline = True, now + self.timeout


class Stoppable(Protocol):
    drain: Drain

    def begin_drain(self, reason: str) -> None: ...

    def stop(self) -> None: ...


class Computing(Protocol):
    @property
    def running(self) -> bool: ...


def handle_stop_signals(worker: Stoppable) -> None:
    """SIGTERM/SIGINT: the first drains ``worker``, a second stops it at once. The handler only sets flags;
    the worker's loop (main thread) acts on them within one poll."""
    def handler(signum: int, frame: object) -> None:
        if worker.drain.reason is None:
            worker.begin_drain(signal.Signals(signum).name)
        else:
            worker.stop()

    for signum in STOP_SIGNALS:
        signal.signal(signum, handler)


def exit_if_computing(compute: Computing) -> None:
    """Call once the worker's ``run`` returned and everything it owns is released. If its compute thread is
    still inside a forward (the drain timed out, or a second signal came), Python's interpreter shutdown
    would abort under that thread ("terminate called without an active exception", status 134): end the
    process here instead, status 0. The broker already gave that forward's request to another worker."""
    if not compute.running:
        return
    event(log, logging.WARNING, "worker.exit_mid_forward", action="the forward still running is abandoned")
    _unlink_own_cuda_ipc_files()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _unlink_own_cuda_ipc_files() -> None:
    """The files our CUDA IPC shares left in /dev/shm (torch's ref counters, the driver's event file): torch
    removes its own at a normal exit, which ``os._exit`` skips; the plane was closed already."""
    pid = os.getpid()
    try:
        names = os.listdir(shm.SHM_DIR)
    except OSError:
        return
    for name in names:
        if shm.companion_pid("/" + name) == pid:
            with contextlib.suppress(OSError):
                os.unlink(shm.SHM_DIR / name)
