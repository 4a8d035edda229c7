"""Requests waiting for their reply, and when and how often each is sent again.

A pending request is in one of two states: in flight (it times out ``timeout`` after its last
counted attempt) or backing off (it is sent again, as a counted attempt, at ``resend_at``; no timeout
meanwhile). Sends that are not the request's fault (a broker lost or restarted, a same-host or NCCL
reply that could not be used) are uncounted: they never use up a retry.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable

from spec_serve.client.errors import RemoteError
from spec_serve.client.received import Received
from spec_serve.client.stats import ClientStats
from spec_serve.protocol.commands import CLIENT_TAG, ClientCommand, control
from spec_serve.protocol.messages import SupervisionRequest, WireMessage
from spec_serve.supervision.contract import Expected
from spec_serve.telemetry.logs import event

log = logging.getLogger("spec_serve.client")

# Delay before retrying a request the broker or a worker could not serve (e.g. its queue for us was
# full): short, so a transient condition costs little.
RETRY_BACKOFF_S = 0.2
# Times a request is sent again at no cost behind its mapping's registration, when the broker answers that it
# lacks the mapping (it restarted, or forgot us): more means the registration itself fails, and the request
# then retries as any other (counted).
MAX_REREGISTRATIONS = 2
# Answered request ids remembered, so that a late second reply counts as a duplicate, not unknown.
RECENT_IDS = 4096


@dataclasses.dataclass
class Pending:
    """One request and its future; ``attempts`` counts its counted sends, ``sent_at`` the last one's time."""

    request_id: bytes
    command: bytes
    service: str
    header: WireMessage  # typed: a SupervisionRequest, or the header of a BIND, STATUS or SET_VOCAB
    payload: list
    future: concurrent.futures.Future
    timeout: float
    max_retries: int | None = None  # None: the client's; BIND uses 0 (a resend could bind a second worker)
    expect: Expected | None = None  # what the reply may hold (contract.reply_specs); None: no tensors
    expect_bytes: int = 0
    attempts: int = 0
    reregistrations: int = 0  # sends behind its mapping's registration (Requests.behind_registration)
    sent_at: float = 0.0
    resend_at: float | None = None  # backing off until then; None: in flight

    @property
    def short_id(self) -> str:
        return self.request_id.hex()[:12]

    def frames(self) -> list:
        return control(CLIENT_TAG, self.command, self.service, self.request_id, self.header, self.payload)

    def counted_send(self, now: float) -> None:
        self.attempts += 1
        self.sent_at = now
        self.resend_at = None

    def uncounted_send(self, now: float, restart_clock: bool) -> None:
        """Sent again at no cost to its retries. Unless ``restart_clock``, an in-flight request keeps its
        timeout clock (a broker that never comes back still fails it: no hung rank)."""
        if restart_clock or self.resend_at is not None:
            self.sent_at = now
        self.resend_at = None

    def back_off(self, until: float) -> None:
        self.resend_at = until

    def due(self, now: float) -> bool:
        return self.resend_at is not None and now >= self.resend_at

    def timed_out(self, now: float) -> bool:
        return self.resend_at is None and now - self.sent_at > self.timeout

    def retries_left(self, client_limit: int) -> bool:
        return self.attempts <= (client_limit if self.max_retries is None else self.max_retries)

    @property
    def request(self) -> SupervisionRequest | None:
        """The supervision request it sends; None for a BIND, STATUS or SET_VOCAB."""
        return self.header if isinstance(self.header, SupervisionRequest) else None

    @property
    def vocab(self) -> str | None:
        """The mapping digest its request names."""
        return self.request.vocab if self.request is not None else None

    @property
    def bound(self) -> bool:
        """Routed to the client's bound worker (not the shared pool)."""
        return self.request is not None and self.request.bound is not None


class PendingTable:
    """Request id -> ``Pending``, with ``expected`` (the bytes their replies may bring) and the last
    ``RECENT_IDS`` ids that left it. Changed on the I/O thread only; ``expected`` and ``len`` are read
    by the ingress watcher thread too."""

    def __init__(self) -> None:
        self._by_id: dict[bytes, Pending] = {}
        self._recent: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.expected = 0
        self.largest = 0  # bytes of the largest reply expected so far (room for one late duplicate)

    def __len__(self) -> int:
        return len(self._by_id)

    def values(self) -> list[Pending]:
        """A snapshot: callers may remove entries while going through it."""
        return list(self._by_id.values())

    def get(self, request_id: bytes) -> Pending | None:
        return self._by_id.get(request_id)

    def add(self, pending: Pending) -> None:
        self.remove(pending.request_id)
        self._by_id[pending.request_id] = pending
        self.expected += pending.expect_bytes
        self.largest = max(self.largest, pending.expect_bytes)

    def remove(self, request_id: bytes) -> Pending | None:
        pending = self._by_id.pop(request_id, None)
        if pending is not None:
            self.expected -= pending.expect_bytes
            self._recent[request_id] = None
            if len(self._recent) > RECENT_IDS:
                self._recent.popitem(last=False)
        return pending

    def answered_recently(self, request_id: bytes) -> bool:
        return request_id in self._recent

    def clear(self) -> None:
        self._by_id.clear()
        self.expected = 0


class Requests:
    """The pending table and its retry policy, on the I/O thread: send, retry, resolve, fail.

    ``send`` puts a request's frames on the broker socket. ``leave_binding(request_id, reason)`` takes a
    request bound to our own worker back to the shared pool as frames: whatever went wrong on the bound
    path (worker lost, group broken, timeout), a retry of it goes there and costs no attempt.
    """

    def __init__(self, send: Callable[[list], None], stats: ClientStats, max_retries: int,
                 leave_binding: Callable[[bytes, str], None]):
        self.table = PendingTable()
        self._send = send
        self._stats = stats
        self._max_retries = max_retries
        self._leave_binding = leave_binding

    def add(self, pending: Pending, now: float) -> None:
        self.table.add(pending)
        self._stats.sent += 1
        self.send_counted(pending, now)

    def send_counted(self, pending: Pending, now: float) -> None:
        pending.counted_send(now)
        self._send(pending.frames())

    def send_uncounted(self, pending: Pending, now: float, restart_clock: bool) -> None:
        pending.uncounted_send(now, restart_clock)
        self._send(pending.frames())

    def retry(self, pending: Pending, now: float, reason: str, delay: float = 0.0,
              exhausted: type[Exception] = TimeoutError) -> None:
        """Send ``pending`` again (after ``delay``), or fail it with ``exhausted`` (RemoteError after error
        replies) once its attempts are used up."""
        if pending.bound:
            self._leave_binding(pending.request_id, reason)
            return
        if not pending.retries_left(self._max_retries):
            self.fail(pending, exhausted(
                f"request {pending.short_id} to service {pending.service!r} failed after "
                f"{pending.attempts} attempts: {reason}"))
            return
        self._stats.retried += 1
        event(log, logging.INFO, "client.retry", request=pending.short_id, reason=reason)
        if delay:
            pending.back_off(now + delay)
        else:
            self.send_counted(pending, now)

    def behind_registration(self, pending: Pending, now: float, reason: str) -> None:
        """The broker lacked the mapping ``pending`` names and we just registered it again (on the same
        connection, so it arrives first): send ``pending`` after it at no cost to its retries, whatever the
        retry setting (not the request's fault); past MAX_REREGISTRATIONS, as a counted retry."""
        if pending.reregistrations >= MAX_REREGISTRATIONS:
            self.retry(pending, now, reason, delay=RETRY_BACKOFF_S, exhausted=RemoteError)
            return
        pending.reregistrations += 1
        self._stats.retried += 1
        self.send_uncounted(pending, now, restart_clock=False)

    def check_timers(self, now: float) -> None:
        """Send those whose back-off ended; retry those that timed out."""
        for pending in self.table.values():
            if pending.due(now):
                self.send_counted(pending, now)
            elif pending.timed_out(now):
                self.retry(pending, now, f"no reply within {pending.timeout:g}s")

    def resolve(self, pending: Pending, reply: Received) -> None:
        self.table.remove(pending.request_id)
        self._stats.completed += 1
        pending.future.set_result(reply)

    def fail(self, pending: Pending, error: BaseException) -> None:
        self.table.remove(pending.request_id)
        if not pending.future.done():
            pending.future.set_exception(error)

    def resend_all(self, now: float) -> None:
        """After a broker was lost or restarted: every request again, at no cost to its retries."""
        for pending in self.table.values():
            if pending.command == ClientCommand.BIND.value:
                # A binding half-made through a lost broker is void; the caller falls back to frames.
                self.fail(pending, RemoteError("broker lost or restarted during BIND"))
                continue
            if pending.command == ClientCommand.REQUEST.value:
                self._stats.retried += 1
            self.send_uncounted(pending, now, restart_clock=False)

    def count_stray(self, request_id: bytes) -> None:
        """A reply with no pending request: a late second answer, or an id we never sent."""
        if self.table.answered_recently(request_id):
            self._stats.duplicates += 1
        else:
            self._stats.unknown += 1
            event(log, logging.WARNING, "client.unknown_reply", request=request_id.hex()[:12])

    def close(self) -> None:
        """The I/O thread stops: nothing will answer what is still pending."""
        for pending in self.table.values():
            if not pending.future.done():
                pending.future.set_exception(RuntimeError("client closed"))
        self.table.clear()
