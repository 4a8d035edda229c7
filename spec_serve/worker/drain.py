"""Stopping a worker the way orchestrators do: SIGTERM (Kubernetes, Slurm, systemd) or SIGINT (Ctrl-C).

The first signal starts a drain: the worker sends LEAVE with ``drain`` at once (the broker sends it
nothing more), hands back the requests it has not started (DONE ``returned``: the broker gives them to
another worker at once), finishes the forward it runs and delivers the replies it owes, waits for
clients to give back the memory they were lent, then leaves for good (LEAVE), releases what its reply
paths hold (shared memory, CUDA IPC handles, pair groups), and exits 0. ``--drain-timeout`` bounds all of it; when
it runs out, or on a second signal, the worker leaves at once: the broker gives what it still held to
other workers, and a forward still running is abandoned (docs/deploy.md).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
from typing import Protocol

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


class Paths(Protocol):
    def before_hard_exit(self) -> None: ...


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


def exit_if_computing(compute: Computing, paths: Paths) -> None:
    """Call once the worker's ``run`` returned and everything it owns is released. If its compute thread is
    still inside a forward (the drain timed out, or a second signal came), Python's interpreter shutdown
    would abort under that thread ("terminate called without an active exception", status 134): end the
    process here instead, status 0, after each reply path removed what the interpreter's exit would have
    (``WorkerSide.before_hard_exit``). The broker already gave that forward's request to another worker."""
    if not compute.running:
        return
    event(log, logging.WARNING, "worker.exit_mid_forward", action="the forward still running is abandoned")
    paths.before_hard_exit()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

