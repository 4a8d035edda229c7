"""``Requests`` and ``PendingTable`` (client/pending.py) without sockets: a recording ``send`` and the test's
clock.

Covered: counted and uncounted sends, a timeout retried at once, a back-off that holds the request (no timeout
meanwhile), the attempt limit (and BIND's none), a request bound to our own worker going back to the pool
instead, a broker loss re-sending everything at no cost, duplicates told from unknown ids, and the table's
byte accounting.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging

import pytest

from spec_serve.client import pending as pending_module
from spec_serve.client.errors import RemoteError
from spec_serve.client.pending import Pending, Requests
from spec_serve.client.received import Received
from spec_serve.client.stats import ClientStats
from spec_serve.protocol.commands import CLIENT_TAG, ClientCommand, new_request_id, parse_control
from spec_serve.protocol.messages import BindRequest, Reply, SupervisionRequest

MAX_RETRIES = 2
TIMEOUT = 1.0


class Harness:
    def __init__(self) -> None:
        self.sent: list[bytes] = []  # request ids, in send order
        self.left_binding: list[tuple[bytes, str]] = []
        self.stats = ClientStats()
        self.requests = Requests(self._send, self.stats, MAX_RETRIES,
                                 lambda request_id, reason: self.left_binding.append((request_id, reason)))

    def _send(self, frames: list) -> None:
        self.sent.append(parse_control(frames, CLIENT_TAG, ClientCommand).request_id)

    def take_sent(self) -> list[bytes]:
        sent, self.sent = self.sent, []
        return sent

    def add(self, now: float = 0.0, command: ClientCommand = ClientCommand.REQUEST, expect_bytes: int = 0,
            **fields) -> Pending:
        header = (SupervisionRequest(reply_to="tcp://127.0.0.1:9", **fields) if command is ClientCommand.REQUEST
                  else BindRequest(reply_to="tcp://127.0.0.1:9"))
        pending = Pending(new_request_id(), command.value, "svc", header, [], concurrent.futures.Future(), TIMEOUT,
                          max_retries=0 if command is ClientCommand.BIND else None, expect_bytes=expect_bytes)
        self.requests.add(pending, now)
        return pending


@pytest.fixture
def h():
    return Harness()


def test_a_request_is_sent_once_as_its_first_counted_attempt(h):
    pending = h.add(now=5.0)
    assert h.take_sent() == [pending.request_id]
    assert (pending.attempts, pending.sent_at, pending.resend_at) == (1, 5.0, None)
    assert h.stats.sent == 1 and len(h.requests.table) == 1


def test_a_timeout_is_retried_at_once_until_the_attempts_run_out(h):
    pending = h.add(now=0.0)
    h.take_sent()
    h.requests.check_timers(TIMEOUT)  # not *more* than the timeout yet
    assert h.take_sent() == []
    for attempt in range(2, MAX_RETRIES + 2):
        h.requests.check_timers(pending.sent_at + TIMEOUT + 0.01)
        assert h.take_sent() == [pending.request_id] and pending.attempts == attempt
    h.requests.check_timers(pending.sent_at + TIMEOUT + 0.01)
    assert h.take_sent() == []
    with pytest.raises(TimeoutError) as failed:
        pending.future.result(0)
    assert str(failed.value) == (f"request {pending.short_id} to service 'svc' failed after {MAX_RETRIES + 1} "
                                 f"attempts: no reply within {TIMEOUT:g}s")
    assert h.stats.retried == MAX_RETRIES and len(h.requests.table) == 0


def test_a_back_off_holds_the_request_without_a_timeout_then_sends_it_counted(h, caplog):
    pending = h.add(now=0.0)
    h.take_sent()
    with caplog.at_level(logging.INFO, logger="spec_serve.client"):
        h.requests.retry(pending, now=0.5, reason="worker w: queue full", delay=0.2)
    assert "client.retry" in caplog.text and "queue full" in caplog.text
    assert pending.resend_at == pytest.approx(0.7) and h.stats.retried == 1
    h.requests.check_timers(0.69)
    assert h.take_sent() == [] and not pending.timed_out(100.0)  # backing off: no timeout meanwhile
    h.requests.check_timers(0.7)
    assert h.take_sent() == [pending.request_id] and (pending.attempts, pending.sent_at) == (2, 0.7)


def test_error_replies_exhaust_into_the_error_type_given(h):
    pending = h.add(now=0.0)
    for now in (1.0, 2.0):
        h.requests.retry(pending, now, "worker w: internal", exhausted=RemoteError)
    h.requests.retry(pending, 3.0, "worker w: internal", exhausted=RemoteError)
    assert pending.attempts == MAX_RETRIES + 1
    with pytest.raises(RemoteError, match="failed after 3 attempts: worker w: internal"):
        pending.future.result(0)


def test_a_bind_is_never_retried(h):
    bind = h.add(command=ClientCommand.BIND)
    h.requests.check_timers(TIMEOUT + 0.01)
    with pytest.raises(TimeoutError, match="failed after 1 attempts"):
        bind.future.result(0)
    assert h.take_sent() == [bind.request_id]


def test_a_request_bound_to_our_worker_goes_back_to_the_pool_instead_of_retrying(h):
    pending = h.add(now=0.0)
    pending.header = dataclasses.replace(pending.header, pin="w1")
    h.requests.retry(pending, now=2.0, reason="no reply within 1s")
    assert h.left_binding == [(pending.request_id, "no reply within 1s")]
    assert pending.attempts == 1 and h.stats.retried == 0 and h.take_sent() == [pending.request_id]


def test_after_a_broker_loss_everything_is_sent_again_at_no_cost(h):
    in_flight, backing_off, bind = h.add(now=0.0), h.add(now=0.0), h.add(command=ClientCommand.BIND)
    h.requests.retry(backing_off, now=0.5, reason="full", delay=0.2)
    h.take_sent()
    h.requests.resend_all(now=0.6)
    assert h.take_sent() == [in_flight.request_id, backing_off.request_id]
    assert [p.attempts for p in (in_flight, backing_off)] == [1, 1]
    assert in_flight.sent_at == 0.0  # keeps its clock: a broker that never comes back still fails it
    assert (backing_off.sent_at, backing_off.resend_at) == (0.6, None)  # now in flight
    with pytest.raises(RemoteError, match="broker lost or restarted during BIND"):
        bind.future.result(0)
    assert h.stats.retried == 3  # the back-off, and the two requests sent again


def test_an_uncounted_send_may_restart_the_clock(h):
    pending = h.add(now=0.0)
    h.requests.send_uncounted(pending, now=0.9, restart_clock=True)
    h.requests.check_timers(1.5)
    assert h.take_sent() == [pending.request_id] * 2 and pending.attempts == 1


def test_a_resolved_request_leaves_the_table_and_a_late_reply_is_a_duplicate(h, caplog):
    pending = h.add(now=0.0)
    answer = Received(pending.request_id, Reply(worker="w"))
    h.requests.resolve(pending, answer)
    assert pending.future.result(0) is answer and h.stats.completed == 1 and len(h.requests.table) == 0
    h.requests.fail(pending, RemoteError("too late"))  # a failure after the answer changes nothing
    assert pending.future.result(0) is answer
    h.requests.count_stray(pending.request_id)
    assert (h.stats.duplicates, h.stats.unknown) == (1, 0)
    h.requests.count_stray(new_request_id())
    assert (h.stats.duplicates, h.stats.unknown) == (1, 1) and "client.unknown_reply" in caplog.text


def test_only_the_last_recent_ids_are_remembered(h, monkeypatch):
    monkeypatch.setattr(pending_module, "RECENT_IDS", 2)
    first, second, third = h.add(), h.add(), h.add()
    for pending in (first, second, third):
        h.requests.fail(pending, RemoteError("x"))
    h.requests.count_stray(first.request_id)
    h.requests.count_stray(third.request_id)
    assert (h.stats.duplicates, h.stats.unknown) == (1, 1)


def test_the_table_counts_the_bytes_replies_may_bring(h):
    small, big = h.add(expect_bytes=100), h.add(expect_bytes=1000)
    table = h.requests.table
    assert (table.expected, table.largest) == (1100, 1000)
    h.requests.table.add(small)  # the same id again: counted once
    assert table.expected == 1100
    h.requests.fail(big, RemoteError("x"))
    assert (table.expected, table.largest) == (100, 1000)  # the largest stays: room for a late duplicate


def test_closing_fails_what_is_still_pending(h):
    pending = h.add()
    h.requests.close()
    with pytest.raises(RuntimeError, match="client closed"):
        pending.future.result(0)
    assert len(h.requests.table) == 0 and h.requests.table.expected == 0
