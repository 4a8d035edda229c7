"""One broker link: the connection state machine that a client's and a worker's session with the broker
share (Majordomo's heartbeat, the Lazy Pirate's fresh socket), apart from any socket, so it runs under a
test without one (tests/protocol/test_broker_link.py).

A link is *up* once the broker answered (a client: any valid message; a worker: the answer to its READY).
Each turn of its owner's loop asks ``tick(now)`` what is due:

- ``beat``: a heartbeat, every ``heartbeat_interval``;
- ``reconnect``: the broker stayed silent past ``liveness`` intervals (``heard`` pushes that back): a fresh
  socket. An outage that starts so is logged once (``<role>.broker_lost``), not once per liveness window,
  and its end once (``<role>.broker_regained``, from ``connected``);
- ``unreachable``: no broker ever answered within ``connect_timeout``: once, so the owner can fail fast (a
  client fails its requests) or say so (a worker keeps trying).

``stopping`` is the broker's last word (it was told to stop): an outage starts at once, logged once.
"""

from __future__ import annotations

import dataclasses
import logging

from spec_serve.telemetry.logs import event


@dataclasses.dataclass(frozen=True)
class Due:
    """What one turn of the owner's loop must do (``BrokerLink.tick``)."""

    beat: bool = False
    reconnect: bool = False
    unreachable: bool = False


class BrokerLink:
    """The state of one peer's link to its broker; single-threaded (its owner's I/O thread).

    ``reconnect_unheard``: a socket that never reached a broker is replaced too (a worker registers again on
    the fresh one); a client's is not (libzmq keeps retrying its connect). ``beat_at_once``: the first
    heartbeat goes on the first turn rather than one interval in."""

    def __init__(self, role: str, broker_url: str, log: logging.Logger, *, heartbeat_interval: float,
                 liveness: int, connect_timeout: float, now: float, reconnect_unheard: bool,
                 beat_at_once: bool = False, regained_level: int = logging.WARNING):
        self.role, self.broker_url, self.log = role, broker_url, log
        self.heartbeat_interval, self.liveness, self.connect_timeout = heartbeat_interval, liveness, connect_timeout
        self.reconnect_unheard = reconnect_unheard
        self.regained_level = regained_level
        self.up = False  # the broker answered (and has not fallen silent or stopped since)
        self.ever_up = False
        self.lost_since: float | None = None  # an outage runs, since when
        self.unreachable = False  # ``unreachable`` was due and no broker answered since
        self.started = now
        self.next_beat = now if beat_at_once else now + heartbeat_interval
        self.expiry = now + self.window

    @property
    def window(self) -> float:
        """How long the broker may stay silent before the link counts it lost."""
        return self.heartbeat_interval * self.liveness

    def heard(self, now: float) -> None:
        """A valid message from the broker: it is alive for another window."""
        self.expiry = now + self.window

    def connected(self, now: float) -> bool:
        """The broker answered (again): the link is up. Ends an outage (logged once) and a fail-fast. True if
        the link was not up before."""
        was_up, self.up, self.ever_up = self.up, True, True
        if self.lost_since is not None:
            event(self.log, self.regained_level, f"{self.role}.broker_regained", broker=self.broker_url,
                  after_s=round(now - self.lost_since, 1))
            self.lost_since = None
        if self.unreachable:
            event(self.log, logging.WARNING, f"{self.role}.broker_reached", broker=self.broker_url)
            self.unreachable = False
        return not was_up

    def stopping(self, now: float, **fields: object) -> None:
        """The broker was told to stop: an outage starts now (one line); its successor ends it."""
        if self.lost_since is None:
            self.lost_since = now
            event(self.log, logging.WARNING, f"{self.role}.broker_stopping", broker=self.broker_url, **fields)
        self.up = False

    def tick(self, now: float) -> Due:
        """What is due this turn (see the module's docstring)."""
        beat = now >= self.next_beat
        if beat:
            self.next_beat = now + self.heartbeat_interval
        reconnect = False
        if now > self.expiry:
            self.expiry = now + self.window
            reconnect = self.ever_up or self.reconnect_unheard
            if self.up:  # it was there: an outage starts (and lasts until ``connected``)
                self.lost_since = now
                event(self.log, logging.WARNING, f"{self.role}.broker_lost", broker=self.broker_url,
                      silent_s=round(self.window, 1))
            self.up = False
        unreachable = not self.ever_up and not self.unreachable and now - self.started > self.connect_timeout
        if unreachable:
            self.unreachable = True
        return Due(beat, reconnect, unreachable)
