"""How many workers a service needs: the rule ``spec-serve status`` advises with (docs/sizing.md).

Pure arithmetic on measured figures; no sockets, no clock of its own. The broker measures the figures
(supply.py): ``Window`` turns cumulative counters into their increase over the last seconds, ``advise`` turns a
service's supply and demand into one line of advice and the worker count it names.

The rule, in short (docs/sizing.md derives it). A rank's step is its own compute plus the time it waited for
supervision. The tokens/s the trainers asked for (``demand``) is throttled by that wait: without it they would
ask ``demand / (1 - wait)``. Each worker delivers ``supply`` tokens per second it is busy. So the workers needed
to keep every trainer computing are ``need = demand / (1 - wait) / mean supply``. Prefetch hides a short supply
(trainers wait 0% while workers are busy 100%): then ``need`` is the workers' busy share, not more, and the
advice is "balanced" rather than "add". Wait without a shortage of workers (``need`` fits the workers there
are) is latency: each step waits for its own request, which ``prefetch_depth`` overlaps with compute.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

# Tolerances of the rule (not thresholds on load): ``need`` may exceed the workers there are by NOISE (a
# measurement's scatter) before "add"; "remove" keeps HEADROOM over ``need`` so that the workers left are not
# saturated at once; a wait above LATENCY_WAIT with enough workers says raise prefetch_depth.
NOISE = 0.05
HEADROOM = 0.10
LATENCY_WAIT = 0.10
# The advice waits until the figures cover this share of the window (ticks are discrete): a shorter history
# is dominated by the start (each rank fills its prefetch at once).
FULL_WINDOW = 0.9
# A trainer that reports it waits nearly all the time (a benchmark that never computes) asks for at most this
# many times what it got: the estimate of its unthrottled demand stays finite.
MIN_COMPUTE_SHARE = 0.05

ADD, REMOVE, BALANCED, IDLE, UNKNOWN = "add", "remove", "balanced", "idle", "unknown"


class Window:
    """Samples ``(t, counters)`` of cumulative counters, the last ``span`` seconds of them (and the one sample
    before, so the increase covers the whole span): ``increase`` is how much each grew, and over how long.

    At most about twice ``resolution`` samples, whatever the span and the rate of ``add``: a sample that follows the
    one before the newest by less than ``span / resolution`` replaces the newest (the newest is always the
    latest counters, the oldest always a full span back)."""

    def __init__(self, span: float, resolution: int = 120):
        self.span = span
        self._gap = span / resolution
        self._samples: collections.deque[tuple[float, tuple[float, ...]]] = collections.deque()

    def add(self, t: float, counters: Sequence[float]) -> None:
        sample = (t, tuple(counters))
        if len(self._samples) >= 2 and t - self._samples[-2][0] < self._gap:
            self._samples[-1] = sample
        else:
            self._samples.append(sample)
        while len(self._samples) > 2 and self._samples[1][0] <= t - self.span:
            self._samples.popleft()

    def increase(self) -> tuple[float, tuple[float, ...]]:
        """``(seconds, per-counter increase)`` between the oldest and newest samples; ``(0, ())`` before two."""
        if len(self._samples) < 2:
            return 0.0, ()
        (t0, first), (t1, last) = self._samples[0], self._samples[-1]
        return t1 - t0, tuple(b - a for a, b in zip(first, last))


def percentiles(values: Sequence[float], *qs: float) -> tuple[float | None, ...]:
    """The nearest-rank ``q`` percentile (0 < q <= 1) of ``values`` for each of ``qs`` (one sort for all); None
    when there are none."""
    if not values:
        return (None,) * len(qs)
    ordered = sorted(values)
    return tuple(ordered[max(0, math.ceil(q * len(ordered)) - 1)] for q in qs)


@dataclasses.dataclass(frozen=True)
class Figures:
    """One service's supply and demand over the broker's window.

    ``seconds``: the history they cover, of the window's ``span`` seconds. ``workers``: those not leaving.
    ``demand_tps``: tokens/s the trainers asked for (their REQUESTs).
    ``ranks``: clients that asked. ``supply_tps``: per worker, tokens/s it delivered while busy (None: it was
    never busy in the window). ``busy``: per worker, the share of the window it held a request. ``wait``: the
    trainers' share of step time spent waiting for supervision (None: no rank reported it)."""

    seconds: float
    span: float
    workers: int
    demand_tps: float
    ranks: int
    supply_tps: tuple[float | None, ...]
    busy: tuple[float, ...]
    wait: float | None

    @property
    def mean_busy(self) -> float:
        return sum(self.busy) / len(self.busy) if self.busy else 0.0

    @property
    def per_worker(self) -> float | None:
        """Tokens/s one worker delivers while busy, the mean over those measured."""
        known = [s for s in self.supply_tps if s is not None and s > 0]
        return sum(known) / len(known) if known else None

    @property
    def need(self) -> float | None:
        """Workers that keep every trainer computing: unthrottled demand over one worker's supply."""
        per_worker = self.per_worker
        if per_worker is None:
            return None
        return self.demand_tps / max(1.0 - (self.wait or 0.0), MIN_COMPUTE_SHARE) / per_worker


@dataclasses.dataclass(frozen=True)
class Advice:
    """What to do about one service: ``action`` (add, remove, balanced, idle, unknown), the worker count it
    names (``workers_needed``; None when nothing was measured), and the one line that says it with the numbers."""

    action: str
    workers_needed: int | None
    line: str
    need: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"action": self.action, "workers_needed": self.workers_needed,
                "need": None if self.need is None else round(self.need, 2), "line": self.line}


def advise(f: Figures) -> Advice:
    """The advice for a service's figures (the rule in this module's docstring and docs/sizing.md)."""
    if f.seconds < f.span * FULL_WINDOW:
        return Advice(UNKNOWN, None, f"measuring: {f.seconds:.0f} of the window's {f.span:.0f} s so far")
    if f.ranks == 0 or f.demand_tps <= 0:
        busy = f" ({f.mean_busy:.0%} busy)" if f.workers else ""
        return Advice(IDLE, 0, f"idle: no trainer asked in the window; {f.workers} workers{busy}")
    if f.workers == 0:
        return Advice(ADD, 1, f"add a worker: {f.ranks} ranks ask {_tps(f.demand_tps)} and no worker serves")
    need = f.need
    if need is None:
        return Advice(UNKNOWN, None, f"unknown: no request finished in the window ({f.ranks} ranks ask "
                                     f"{_tps(f.demand_tps)}, {f.workers} workers)")
    wait = "trainers' wait not reported" if f.wait is None else f"trainers wait {f.wait:.0%} of each step"
    numbers = (f"need {need:.1f} for {_tps(f.demand_tps / max(1 - (f.wait or 0.0), MIN_COMPUTE_SHARE))} "
               f"at {_tps(f.per_worker or 0.0)} each")
    if need > f.workers * (1 + NOISE):
        needed = math.ceil(need)
        more = needed - f.workers
        return Advice(ADD, needed, f"add {more} worker{'s' if more > 1 else ''}: {wait}, workers busy "
                                   f"{f.mean_busy:.0%} ({numbers})", need)
    keep = max(1, math.ceil(need * (1 + HEADROOM)))
    if keep < f.workers:
        return Advice(REMOVE, keep, f"{keep} of {f.workers} workers would do: busy {f.mean_busy:.0%}, {wait} "
                                    f"({numbers})", need)
    if f.wait is not None and f.wait > LATENCY_WAIT:
        return Advice(BALANCED, f.workers, f"balanced workers, but {wait} while they could keep up: latency, "
                                           f"not capacity; raise prefetch_depth ({numbers})", need)
    return Advice(BALANCED, f.workers, f"balanced: {wait}, workers busy {f.mean_busy:.0%} ({numbers})", need)


def _tps(tokens_per_s: float) -> str:
    return f"{tokens_per_s:,.0f} tokens/s"
