"""A rank's demand, measured where the trainer calls: how long its steps wait for supervision, how long it
computes between requests, the tokens it asks for (docs/sizing.md).

A step runs from one ``generate_batch``/``generate_batch_async`` call to the next. Its wait is the time the
caller was blocked for supervision: in ``result()`` of a batch not ready yet, or for a prefetch credit (all
``prefetch_depth`` batches in flight); overlapping waits of several threads count once. The rest of the step is
the trainer's own compute. The counts go to ``client.stats``, to Prometheus series in the trainer's process,
and to the broker with each heartbeat (``report``: a ``ClientHeartbeat``, counted up to the moment it is sent).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from spec_serve.client.stats import ClientStats
from spec_serve.protocol.messages import ClientHeartbeat
from spec_serve.telemetry.metrics import (
    CLIENT_COMPUTE_SECONDS,
    CLIENT_REQUESTED_TOKENS,
    CLIENT_STEPS,
    CLIENT_WAIT_SECONDS,
)


class DemandMeter:
    """Steps, waits and compute of one client (``RemoteTargetModel``); any thread may call it."""

    def __init__(self, stats: ClientStats, service: str):
        self.stats = stats
        self.service = service
        self._lock = threading.Lock()
        self._step_started: float | None = None  # the last ask; None before the first
        self._waited_in_step = 0.0  # finished waits since then
        self._waiters = 0  # threads blocked now
        self._wait_started = 0.0  # when the first of them blocked

    def step(self) -> None:
        """A batch is asked for: the step before it ends (its compute is what it did not wait)."""
        now = time.monotonic()
        with self._lock:
            computed = self._computing(now)
            self.stats.compute_s += computed
            self.stats.steps += 1
            self._step_started, self._waited_in_step = now, 0.0
        CLIENT_STEPS.labels(service=self.service).inc()
        CLIENT_COMPUTE_SECONDS.labels(service=self.service).inc(computed)

    def requested(self, tokens: int) -> None:
        """The asked batch holds ``tokens`` real tokens."""
        with self._lock:
            self.stats.requested_tokens += tokens
        CLIENT_REQUESTED_TOKENS.labels(service=self.service).inc(tokens)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """The caller is blocked for supervision while inside."""
        with self._lock:
            if self._waiters == 0:
                self._wait_started = time.monotonic()
            self._waiters += 1
        try:
            yield
        finally:
            with self._lock:
                self._waiters -= 1
                waited = time.monotonic() - self._wait_started if self._waiters == 0 else 0.0
                self.stats.wait_s += waited
                self._waited_in_step += waited
            if waited:
                CLIENT_WAIT_SECONDS.labels(service=self.service).inc(waited)

    def _computing(self, now: float) -> float:
        """Compute of the step in progress up to ``now`` (lock held): its time, less what it waited."""
        if self._step_started is None:
            return 0.0
        ongoing = now - self._wait_started if self._waiters else 0.0
        return max(0.0, now - self._step_started - self._waited_in_step - ongoing)

    def report(self) -> tuple[str, ClientHeartbeat | None]:
        """The service and the heartbeat header reporting this rank's counters up to now (None before it asked)."""
        now = time.monotonic()
        with self._lock:
            if self._step_started is None:
                return self.service, None
            ongoing = now - self._wait_started if self._waiters else 0.0
            return self.service, ClientHeartbeat(steps=self.stats.steps,
                                                 wait_s=round(self.stats.wait_s + ongoing, 6),
                                                 compute_s=round(self.stats.compute_s + self._computing(now), 6))


class MeteredFuture(concurrent.futures.Future):
    """A batch's future whose ``result()``/``exception()`` count the time the caller is blocked as waiting."""

    def __init__(self, meter: DemandMeter):
        super().__init__()
        self._meter = meter

    def result(self, timeout: float | None = None) -> Any:
        if self.done():
            return super().result()
        with self._meter.waiting():
            return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if self.done():
            return super().exception()
        with self._meter.waiting():
            return super().exception(timeout)


def metered(source: concurrent.futures.Future, meter: DemandMeter) -> MeteredFuture:
    """A ``MeteredFuture`` that settles as ``source`` does."""
    out = MeteredFuture(meter)

    def settle(done: concurrent.futures.Future) -> None:
        if out.done():  # the caller cancelled it
            return
        if done.cancelled():
            out.cancel()
        elif done.exception() is not None:
            out.set_exception(done.exception())
        else:
            out.set_result(done.result())

    source.add_done_callback(settle)
    return out
