"""``Dispatcher`` (broker/dispatch.py) without sockets: suspects run alone, a request that kills workers
fails after ``max_request_deaths``, ``avoid``, retries kept once, and an unreachable worker."""

from __future__ import annotations

import collections
import time

import pytest
import torch

from broker_util import SERVICE, done, handle, keep_alive, make_router, ready, submit
from spec_serve.broker.context import Peer
from spec_serve.protocol import wire
from spec_serve.protocol.commands import CLIENT_TAG, WORKER_TAG, ClientCommand, ErrorCode, WorkerCommand


@pytest.fixture
def router():
    return make_router()


def expire(router, worker: bytes, now: float, *alive: bytes) -> None:
    """``worker`` went silent after ``now``: every peer in ``alive`` heartbeats, then the purge after its expiry.
    (Worker names are their identities' first 6 bytes in hex: these tests' differ there.)"""
    later = now + router.expiry_window + 0.1
    for peer in alive:
        if router.worker_seen(peer, later) is None:
            router.client_seen(peer, later)
    router.purge(later)
    assert worker not in router.workers


def test_a_request_on_a_dying_worker_runs_alone_next(router):
    now = time.monotonic()
    ready(router, b"A-worker", now)
    suspect = submit(router, b"client", now)
    ready(router, b"B-worker", now, capacity=2)
    router.recorder.take()
    expire(router, b"A-worker", now, b"B-worker", b"client")
    assert router.recorder.requests_to(b"B-worker") == [suspect]
    assert router.requests[suspect].killed == [b"A-worker".hex()[:12]]
    router.recorder.take()
    later = now + router.expiry_window + 0.2
    other = submit(router, b"client", later)
    assert router.recorder.requests_to(b"B-worker") == []  # it holds a suspect: nothing beside it
    done(router, b"B-worker", suspect, later)
    assert router.recorder.requests_to(b"B-worker") == [other]


def test_a_request_fails_after_killing_max_request_deaths_workers(router):
    """The error names the request's input (op, kind, tokens, each tensor's shape) and the workers it killed."""
    now = time.monotonic()
    ready(router, b"A-worker", now, host="gpu-1", pid=101)
    ids = torch.full((1, 8), 7)
    payload = wire.encode({"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)})
    poison = submit(router, b"client", now, payload=payload, kind="eagle3", tokens=8)
    ready(router, b"B-worker", now, host="gpu-2", pid=202)
    expire(router, b"A-worker", now, b"B-worker", b"client")
    router.recorder.take()
    later = now + router.expiry_window + 0.1  # when B-worker was last seen
    ready(router, b"C-worker", later)
    expire(router, b"B-worker", later, b"C-worker", b"client")
    [error] = router.recorder.to_client(b"client")
    assert error.request_id == poison and error.header["code"] == ErrorCode.KILLED_WORKERS.value
    a, b = b"A-worker".hex()[:12], b"B-worker".hex()[:12]
    assert (f"request {poison.hex()} (generate eagle3 8 tokens, input_ids [1, 8] I64, attention_mask [1, 8] I64, "
            f"loss_mask [1, 8] I64) was on 2 workers of 'svc' as they died ({a} (host gpu-1, pid 101); "
            f"{b} (host gpu-2, pid 202))") in error.header["error"]
    assert poison not in router.requests and router.metrics.killer_requests._value.get() == 1
    router.recorder.take()
    # a retry that crossed the error is refused the same way, never dispatched
    _retry(router, b"client", poison, now)
    assert [m.header["code"] for m in router.recorder.to_client(b"client")] == [ErrorCode.KILLED_WORKERS.value]
    assert router.recorder.requests_to(b"C-worker") == []


def _retry(router, client: bytes, request_id: bytes, now: float) -> None:
    """``client`` sends ``request_id`` again (a retry keeps its id)."""
    handle(router.enqueue, router.client_seen(client, now), now, CLIENT_TAG, ClientCommand.REQUEST, request_id,
           {"reply_to": "tcp://127.0.0.1:9", "timeout": 30})


def test_a_retry_of_a_held_request_is_kept_once(router):
    now = time.monotonic()
    ready(router, b"A-worker", now)
    request_id = submit(router, b"client", now, timeout=5)
    router.recorder.take()
    _retry(router, b"client", request_id, now + 1)
    assert router.recorder.take() == []
    assert router.requests[request_id].deadline == now + 31 and len(router.requests) == 1


def test_avoid_sends_the_retry_to_another_worker(router):
    now = time.monotonic()
    ready(router, b"B-worker", now, capacity=2)
    submit(router, b"client", now)  # B-worker: half loaded
    ready(router, b"A-worker", now, capacity=4)
    router.recorder.take()
    plain = submit(router, b"client", now)
    assert router.recorder.requests_to(b"A-worker") == [plain]  # the least loaded
    done(router, b"A-worker", plain, now)
    router.recorder.take()
    retry = submit(router, b"client", now, avoid=b"A-worker".hex()[:12])
    assert router.recorder.requests_to(b"B-worker") == [retry]


def test_an_unreachable_worker_is_removed_and_its_request_goes_elsewhere(router):
    now = time.monotonic()
    ready(router, b"A-worker", now)
    ready(router, b"B-worker", now)
    router.recorder.unreachable.add(b"A-worker")
    router.recorder.unreachable.add(b"B-worker")
    request_id = submit(router, b"client", now)
    assert not router.workers and router.services["svc"].queue_depth() == 1
    router.recorder.unreachable.clear()
    ready(router, b"C-worker", now)
    assert router.recorder.requests_to(b"C-worker") == [request_id]


def test_a_done_that_comes_after_its_client_left_is_counted(router):
    """A client may close (DISCONNECT) as soon as it holds its reply, which comes straight from the worker
    and so often beats the worker's DONE to the broker: that DONE still counts in the metrics (it did
    not: a one-request client sometimes left every counter at zero). Its worker's slot is freed at once."""
    now = time.monotonic()
    ready(router, b"A-worker", now)
    ready(router, b"B-worker", now)
    request_id = submit(router, b"client", now)
    busy = next(w for w in (b"A-worker", b"B-worker") if router.recorder.requests_to(w) == [request_id])
    other = b"B-worker" if busy == b"A-worker" else b"A-worker"
    handle(router.disconnect, router.client_seen(b"client", now), now, CLIENT_TAG, ClientCommand.DISCONNECT)
    assert router.workers[busy].free == 1
    # Another worker's DONE of that id (a request it no longer holds) counts nothing.
    done(router, other, request_id, now + 1.0, tokens=7, bytes=100)
    assert _sample(router, "spec_serve_completed_total", status="ok") == 0
    done(router, busy, request_id, now + 1.5, tokens=7, bytes=100)
    assert _sample(router, "spec_serve_completed_total", status="ok") == 1
    assert _sample(router, "spec_serve_tokens_total") == 7
    assert _sample(router, "spec_serve_reply_bytes_total") == 100
    assert _sample(router, "spec_serve_request_latency_seconds_count") == 1
    assert _sample(router, "spec_serve_request_latency_seconds_sum") == pytest.approx(1.5)
    assert router.workers[busy].completed == 1
    # Counted once: a repeated DONE finds nothing.
    done(router, busy, request_id, now + 2.0, tokens=7, bytes=100)
    assert _sample(router, "spec_serve_completed_total", status="ok") == 1
    assert not router.dispatcher.detached


def _sample(router, name: str, **labels: str) -> float:
    return router.metrics.registry.get_sample_value(name, {"service": SERVICE, **labels}) or 0.0


def _every_request_sent(router) -> list[bytes]:
    """The ids of every REQUEST the broker sent any worker so far (the recorder keeps them all)."""
    return [m.request_id for peer, _, m in router.recorder.sent
            if peer is Peer.WORKER and m.command == WorkerCommand.REQUEST.value]


@pytest.mark.parametrize("death", ["heartbeat", "leave", "unreachable", "deadline"])
def test_a_dying_worker_never_gets_its_answered_requests_sent_again(router, death):
    """A worker answers two of the three requests it holds (DONE ok), then goes: silent past its expiry, its
    engine dead (LEAVE), unreachable at the next send, or past a request's deadline. Only the unanswered one
    is sent again, once, to the other worker; each answered one was sent exactly once in all (a broker that
    re-sent them would make the client receive each twice)."""
    now = time.monotonic()
    ready(router, b"A-worker", now, capacity=3)
    held = [submit(router, b"client", now, timeout=5) for _ in range(3)]
    assert router.recorder.requests_to(b"A-worker") == held
    for request_id in held[:2]:
        done(router, b"A-worker", request_id, now + 0.1)
    later = now + 0.3
    if death == "unreachable":  # found so by the send of a new request, before another worker came
        router.recorder.unreachable.add(b"A-worker")
        submit(router, b"other-client", later)
    ready(router, b"B-worker", now + 0.2, capacity=4)
    ready(router, b"C-worker", now + 0.2)  # a request on a dying worker then runs alone, on an idle one
    if death == "heartbeat":
        expire(router, b"A-worker", later, b"B-worker", b"C-worker", b"client", b"other-client")
    elif death == "leave":
        handle(router.worker_left, router.workers[b"A-worker"], later, WORKER_TAG, WorkerCommand.LEAVE,
               header={"reason": "engine died"})
    elif death == "deadline":
        router.dispatcher.expire(now + 6)
    sent = collections.Counter(_every_request_sent(router))
    assert [sent[r] for r in held] == [1, 1, 2], death
    assert router.metrics.redispatched._value.get() >= 1


def test_a_request_a_forgotten_client_sends_again_while_its_worker_runs_it_is_not_run_twice(router):
    """The broker forgets a client that was only late (DISCONNECT), with a request on A-worker; the client sends
    it again. A-worker still runs it, so it is held as A-worker's again, not sent to anyone (B-worker is idle):
    the client gets one reply. Its DONE completes it; had A-worker died instead, it would go to B-worker."""
    now = time.monotonic()
    ready(router, b"A-worker", now)
    request_id = submit(router, b"client", now)
    assert router.recorder.requests_to(b"A-worker") == [request_id]
    ready(router, b"B-worker", now)
    later = now + router.expiry_window + 0.1
    keep_alive(router, later, b"A-worker", b"B-worker")
    router.purge(later)
    assert b"client" not in router.clients and request_id not in router.requests
    router.recorder.take()
    _retry(router, b"client", request_id, later)
    assert router.recorder.take() == [] and router.requests[request_id].worker == b"A-worker"
    assert router.workers[b"A-worker"].free == 0
    dying = router.requests[request_id]
    expire(router, b"A-worker", later, b"B-worker", b"client")
    assert router.recorder.requests_to(b"B-worker") == [request_id] and dying.killed
