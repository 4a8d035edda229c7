"""Routing as a ranking (broker/ranking.py) without sockets: each rule on its own, and the rules in their
order through ``Dispatcher.dispatch``: isolation, anti-affinity, affinity, then locality before load."""

from __future__ import annotations

import time

import pytest

from broker_util import done, make_router, ready, submit
from spec_serve.broker import ranking
from spec_serve.broker.state import Request, RequestTable, WorkerState
from spec_serve.protocol.messages import SupervisionRequest

HOST_A, HOST_B = "boot-a:net-1:mnt-1:pid-1", "boot-b:net-2:mnt-2:pid-2"
REPLY_TO = "tcp://127.0.0.1:9"


def _worker(name: bytes, host_key: str | None = None, inflight: int = 0, capacity: int = 2,
            idle_since: float = 0.0) -> WorkerState:
    return WorkerState(name, "svc", {}, capacity, 1e9, 0.0, inflight={bytes([i]) * 16 for i in range(inflight)},
                       host_key=host_key, idle_since=idle_since)


def _request(**header) -> Request:
    return Request(b"r" * 16, b"client", "svc", SupervisionRequest(reply_to=REPLY_TO, **header), [], 1e9, 0.0)


def test_locality_comes_before_load_and_load_before_idleness():
    near = _request(near=HOST_A)
    local_busy = _worker(b"A-worker", HOST_A, inflight=1)
    remote_idle = _worker(b"B-worker", HOST_B, idle_since=-5.0)
    assert ranking.best(near, [remote_idle, local_busy]) is local_busy  # its host's worker while it has a slot
    # No host asked for: the least-loaded, then the longest idle.
    assert ranking.best(_request(), [local_busy, remote_idle]) is remote_idle
    older = _worker(b"C-worker", HOST_B, idle_since=-9.0)
    assert ranking.best(near, [remote_idle, older]) is older  # nobody of its host: load, then idleness
    assert ranking.best(_request(near="elsewhere"), [local_busy, remote_idle]) is remote_idle


def test_isolation_anti_affinity_and_affinity_decide_who_may_take_it():
    idle, busy = _worker(b"A-worker"), _worker(b"B-worker", inflight=1)
    suspect = _request()
    suspect.killed.append("dead-worker")
    assert ranking.eligible(suspect, [idle, busy], [idle, busy]) == [idle]  # a suspect: an idle worker only
    missed = _request()
    missed.missed.add(idle.identity)
    assert ranking.eligible(missed, [idle, busy], [idle, busy]) == [busy]
    avoiding = _request(avoid=idle.name)
    assert ranking.eligible(avoiding, [idle, busy], [idle, busy]) == [busy]
    assert ranking.eligible(avoiding, [idle], [idle]) == [idle]  # no other worker: the avoided one after all
    assert ranking.eligible(_request(pin=busy.name), [idle, busy], [idle, busy]) == [busy]
    # The rules in their order: a suspect pinned to a busy worker has nowhere to go now.
    pinned_suspect = _request(pin=busy.name)
    pinned_suspect.killed.append("dead-worker")
    assert ranking.eligible(pinned_suspect, [idle, busy], [idle, busy]) == []


def test_a_worker_holding_a_suspect_is_not_free():
    requests = RequestTable()
    suspect = _request()
    suspect.killed.append("dead-worker")
    requests[suspect.request_id] = suspect
    holder = _worker(b"A-worker", capacity=4)
    holder.inflight.add(suspect.request_id)
    full = _worker(b"B-worker", inflight=2)
    assert ranking.free([holder, full, _worker(b"C-worker")], requests) == [_worker(b"C-worker")]


@pytest.fixture
def router():
    return make_router()


def test_dispatch_keeps_a_near_request_on_its_host_while_that_worker_has_a_slot(router):
    """Two hosts, a worker on each: the requests of a client on host A go to A's worker while it has a free
    slot; B's worker takes one only when A's is full (waiting for A would queue it)."""
    now = time.monotonic()
    ready(router, b"A-worker", now, capacity=1, host_key=HOST_A)
    ready(router, b"B-worker", now - 10, capacity=1, host_key=HOST_B)  # idle longer: load alone would pick it
    router.recorder.take()
    first = submit(router, b"client", now, near=HOST_A)
    assert router.recorder.requests_to(b"A-worker") == [first]
    done(router, b"A-worker", first, now + 1)
    router.recorder.take()
    second = submit(router, b"client", now + 1, near=HOST_A)
    third = submit(router, b"client", now + 1, near=HOST_A)  # A's worker is full now: B's saves the wait
    assert router.recorder.requests_to(b"A-worker") == [second]
    assert router.recorder.requests_to(b"B-worker") == [third]
    router.recorder.take()
    plain = submit(router, b"other", now + 2)
    done(router, b"A-worker", second, now + 3)
    assert router.recorder.requests_to(b"A-worker") == [plain]  # queued for any worker: the first one free


def test_without_near_the_longest_idle_worker_takes_it(router):
    """What the ranking does without locality, unchanged: the least-loaded, ties to the longest idle."""
    now = time.monotonic()
    ready(router, b"A-worker", now, capacity=1, host_key=HOST_A)
    ready(router, b"B-worker", now - 10, capacity=1, host_key=HOST_B)
    router.recorder.take()
    request = submit(router, b"client", now)
    assert router.recorder.requests_to(b"B-worker") == [request]
