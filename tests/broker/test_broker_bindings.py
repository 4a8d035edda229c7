"""``Bindings`` (broker/binding.py) without sockets: a client takes a worker of its own, the pool skips
it, and the binding ends with a RELEASE, the client, or the worker."""

from __future__ import annotations

import time

import pytest

from broker_util import SERVICE, done, handle, keep_alive, make_router, ready, submit
from spec_serve.broker import binding
from spec_serve.protocol.commands import CLIENT_TAG, WORKER_TAG, ClientCommand, ErrorCode, WorkerCommand, new_request_id


@pytest.fixture
def router():
    return make_router()


def bind(router, client: bytes, now: float, device_type: str = "cpu") -> bytes:
    request_id = new_request_id()
    header = {"reply_to": "tcp://127.0.0.1:9", "timeout": 10, "device_type": device_type}
    handle(router.bindings.bind, router.client_seen(client, now), now, CLIENT_TAG, ClientCommand.BIND, request_id,
           header)
    return request_id


def release(router, client: bytes, now: float, prefix: str | None = None) -> None:
    handle(router.bindings.release, router.client_seen(client, now), now, CLIENT_TAG, ClientCommand.RELEASE,
           header={"prefix": prefix})


def test_a_bound_worker_leaves_the_pool_until_released(router):
    now = time.monotonic()
    ready(router, b"A-worker", now)
    bind_id = bind(router, b"client-a", now)
    assert router.recorder.commands_to(b"A-worker", WorkerCommand.BIND) == [bind_id]
    assert router.workers[b"A-worker"].bound_to == b"client-a"
    router.recorder.take()
    queued = submit(router, b"client-b", now)
    assert router.recorder.requests_to(b"A-worker") == []  # the pool skips a bound worker
    release(router, b"client-a", now)
    assert router.recorder.commands_to(b"A-worker", WorkerCommand.RELEASE) == [b""]
    assert router.recorder.requests_to(b"A-worker") == [queued]


def test_bound_requests_go_to_the_bound_worker_only(router):
    now = time.monotonic()
    ready(router, b"A-worker", now)
    ready(router, b"B-worker", now)
    bind(router, b"client", now)
    worker = next(w for w in router.workers.values() if w.bound_to == b"client")
    router.recorder.take()
    request_id = submit(router, b"client", now, pin=worker.name)
    assert router.recorder.requests_to(worker.identity) == [request_id]
    wrong = submit(router, b"client", now, pin="0" * 12)
    [error] = router.recorder.to_client(b"client")
    assert error.request_id == wrong and error.header["unpinned"] is True


def test_bind_is_refused_when_every_worker_is_bound(router):
    now = time.monotonic()
    ready(router, b"A-worker", now)
    bind(router, b"client-a", now)
    refused = bind(router, b"client-b", now)
    [answer] = router.recorder.to_client(b"client-b", ClientCommand.BOUND)
    assert answer.request_id == refused and answer.header["ok"] is False
    assert answer.header["code"] == ErrorCode.UNAVAILABLE.value and "bound to other clients" in answer.header["error"]


def test_a_client_binds_one_worker_at_a_time(router):
    now = time.monotonic()
    ready(router, b"A-worker", now)
    ready(router, b"B-worker", now)
    bind(router, b"client", now)
    [first] = router.bindings.bound_to(b"client")
    router.recorder.take()
    bind(router, b"client", now)
    assert router.recorder.commands_to(first.identity, WorkerCommand.RELEASE) == [b""]  # the first binding ended
    assert len(router.bindings.bound_to(b"client")) == 1


def test_the_binding_ends_with_its_client_or_its_worker(router):
    now = time.monotonic()
    ready(router, b"A-worker", now)
    bind(router, b"client", now)
    router.delete_client(b"client")
    assert router.workers[b"A-worker"].bound_to is None
    bind(router, b"client", now)
    prefix = router.workers[b"A-worker"].bind_prefix
    request_id = submit(router, b"client", now, pin=b"A-worker".hex()[:12])
    router.recorder.take()
    router.delete_worker(router.workers[b"A-worker"], now, reason="heartbeat expired")
    [lost] = router.recorder.to_client(b"client", ClientCommand.BOUND)
    assert lost.header["lost"] == b"A-worker".hex()[:12] and lost.header["prefix"] == prefix
    [error] = router.recorder.to_client(b"client")
    assert error.request_id == request_id and error.header["unpinned"] is True
    assert SERVICE in router.services and not router.requests


def test_a_done_for_a_bound_request_frees_the_slot_not_the_binding(router):
    now = time.monotonic()
    ready(router, b"A-worker", now)
    bind(router, b"client", now)
    request_id = submit(router, b"client", now, pin=b"A-worker".hex()[:12])
    done(router, b"A-worker", request_id, now)
    assert router.workers[b"A-worker"].bound_to == b"client" and not router.workers[b"A-worker"].inflight


# ------------------------------------------------------------ what a client's word cannot keep (issue 24, item 4)


def answer_bind(router, worker: bytes, bind_id: bytes, now: float, status: str, error: str | None = None) -> None:
    header = {"status": status, **({"error": error} if error else {})}
    handle(router.complete, router.worker_seen(worker, now), now, WORKER_TAG, WorkerCommand.DONE, bind_id, header)


@pytest.mark.parametrize("status", ["error", "undeliverable"])
def test_a_bind_the_worker_does_not_grant_ends_at_its_done(router, status):
    """The worker refused the BIND (CURVE, another device type) or could not deliver the grant: the broker
    gives the worker back to the pool at once and tells the client (the old broker kept it bound)."""
    now = time.monotonic()
    ready(router, b"A-worker", now)
    bind_id = bind(router, b"client", now, device_type="cuda")
    queued = submit(router, b"client", now)
    router.recorder.take()
    answer_bind(router, b"A-worker", bind_id, now, status, error="refused" if status == "undeliverable" else None)
    assert router.workers[b"A-worker"].bound_to is None
    assert router.recorder.commands_to(b"A-worker", WorkerCommand.RELEASE) == [b""]
    assert router.recorder.requests_to(b"A-worker") == [queued]
    told = router.recorder.to_client(b"client", ClientCommand.BOUND)
    if status == "error":  # the worker's refusal reached the client: nothing to add
        assert told == []
    else:  # the client never heard: BOUND ok=false answers its BIND
        [lost] = told
        assert lost.request_id == bind_id and lost.header["ok"] is False and status in lost.header["error"]


def test_a_granted_bind_stays(router):
    now = time.monotonic()
    ready(router, b"A-worker", now)
    bind_id = bind(router, b"client", now)
    answer_bind(router, b"A-worker", bind_id, now, "ok")
    assert router.workers[b"A-worker"].bound_to == b"client"


def test_an_idle_binding_ends_after_bind_idle_s(router, monkeypatch):
    monkeypatch.setattr(binding, "BIND_IDLE_S", 5.0)
    now = time.monotonic()
    ready(router, b"A-worker", now)
    bind(router, b"client", now)
    request_id = submit(router, b"client", now + 4, pin=b"A-worker".hex()[:12])
    keep_alive(router, now + 6, b"A-worker", b"client")
    router.purge(now + 6)
    assert router.workers[b"A-worker"].bound_to == b"client"  # a request on it: in use
    done(router, b"A-worker", request_id, now + 6)
    keep_alive(router, now + 10, b"A-worker", b"client")
    router.purge(now + 10)
    assert router.workers[b"A-worker"].bound_to == b"client"  # 4 s since its last DONE
    router.recorder.take()
    keep_alive(router, now + 11.5, b"A-worker", b"client")
    router.purge(now + 11.5)
    assert router.workers[b"A-worker"].bound_to is None
    [lost] = router.recorder.to_client(b"client", ClientCommand.BOUND)
    assert "idle for 5s" in lost.header["error"]


def test_the_last_unbound_worker_stays_in_the_pool_while_another_client_uses_it(router):
    now = time.monotonic()
    ready(router, b"A-worker", now)
    ready(router, b"B-worker", now)
    submit(router, b"pool-user", now)  # a client of the service without a binding
    bind(router, b"client-1", now)
    refused = bind(router, b"client-2", now)
    [answer] = router.recorder.to_client(b"client-2", ClientCommand.BOUND)
    assert answer.request_id == refused and "stays in the pool: 1 other client(s)" in answer.header["error"]
    assert sum(w.bound_to is not None for w in router.workers.values()) == 1


def test_every_client_binds_when_there_are_workers_for_all(router):
    now = time.monotonic()
    for worker in (b"A-worker", b"B-worker"):
        ready(router, worker, now)
    for client in (b"client-1", b"client-2"):
        submit(router, client, now)  # both use the service, then each binds
    for client in (b"client-1", b"client-2"):
        bind(router, client, now)
    assert {w.bound_to for w in router.workers.values()} == {b"client-1", b"client-2"}


def test_waiting_requests_end_the_newest_binding_when_every_worker_is_bound(router):
    now = time.monotonic()
    ready(router, b"A-worker", now)
    ready(router, b"B-worker", now)
    bind(router, b"client-1", now)
    bind(router, b"client-2", now + 1)
    newest = next(w for w in router.workers.values() if w.bound_to == b"client-2")
    waiting = submit(router, b"pool-user", now + 1)
    router.recorder.take()
    keep_alive(router, now + 1.5, b"A-worker", b"B-worker", b"client-1", b"client-2", b"pool-user")
    router.purge(now + 1.5)
    assert newest.bound_to is None and router.recorder.requests_to(newest.identity) == [waiting]
    [lost] = router.recorder.to_client(b"client-2", ClientCommand.BOUND)
    assert "every worker is bound" in lost.header["error"]
    assert router.bindings.bound_to(b"client-1")  # one binding ended, not all


def test_a_curve_broker_refuses_bind_before_taking_a_worker():
    router = make_router(bind_refusal="this broker runs CURVE")
    now = time.monotonic()
    ready(router, b"A-worker", now)
    refused = bind(router, b"client", now)
    assert router.recorder.commands_to(b"A-worker", WorkerCommand.BIND) == []
    [answer] = router.recorder.to_client(b"client", ClientCommand.BOUND)
    assert answer.request_id == refused and answer.header["error"] == "this broker runs CURVE"
    assert router.workers[b"A-worker"].bound_to is None


def test_the_pair_group_timeout_a_client_asks_is_capped(router):
    now = time.monotonic()
    ready(router, b"A-worker", now)
    request_id = new_request_id()
    header = {"reply_to": "tcp://127.0.0.1:9", "timeout": 1e6, "device_type": "cpu"}
    handle(router.bindings.bind, router.client_seen(b"client", now), now, CLIENT_TAG, ClientCommand.BIND, request_id,
           header)
    [sent] = [m for _, who, m in router.recorder.sent if m.command == WorkerCommand.BIND.value]
    assert sent.header["timeout"] == binding.MAX_BIND_TIMEOUT_S
