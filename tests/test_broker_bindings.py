"""``Bindings`` (broker/binding.py) without sockets: a client takes a worker of its own, the pool skips
it, and the binding ends with a RELEASE, the client, or the worker."""

from __future__ import annotations

import time

import pytest

from broker_util import SERVICE, done, make_router, message, ready, submit
from spec_serve.protocol.commands import CLIENT_TAG, ClientCommand, ErrorCode, WorkerCommand, new_request_id


@pytest.fixture
def router():
    return make_router()


def bind(router, client: bytes, now: float, device_type: str = "cpu") -> bytes:
    request_id = new_request_id()
    header = {"reply_to": "tcp://127.0.0.1:9", "timeout": 10, "device_type": device_type}
    router.bindings.bind(router.client_seen(client, now), message(CLIENT_TAG, ClientCommand.BIND, request_id, header),
                         now)
    return request_id


def release(router, client: bytes, now: float, prefix: str | None = None) -> None:
    router.bindings.release(router.client_seen(client, now),
                            message(CLIENT_TAG, ClientCommand.RELEASE, header={"prefix": prefix}), now)


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
    request_id = submit(router, b"client", now, bound=worker.name, nccl=True)
    assert router.recorder.requests_to(worker.identity) == [request_id]
    wrong = submit(router, b"client", now, bound="0" * 12)
    [error] = router.recorder.to_client(b"client")
    assert error.request_id == wrong and error.header["unbound"] is True


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
    request_id = submit(router, b"client", now, bound=b"A-worker".hex()[:12], nccl=True)
    router.recorder.take()
    router.delete_worker(router.workers[b"A-worker"], now, reason="heartbeat expired")
    [lost] = router.recorder.to_client(b"client", ClientCommand.BOUND)
    assert lost.header["lost"] == b"A-worker".hex()[:12] and lost.header["prefix"] == prefix
    [error] = router.recorder.to_client(b"client")
    assert error.request_id == request_id and error.header["unbound"] is True
    assert SERVICE in router.services and not router.requests


def test_a_done_for_a_bound_request_frees_the_slot_not_the_binding(router):
    now = time.monotonic()
    ready(router, b"A-worker", now)
    bind(router, b"client", now)
    request_id = submit(router, b"client", now, bound=b"A-worker".hex()[:12], nccl=True)
    done(router, b"A-worker", request_id, now)
    assert router.workers[b"A-worker"].bound_to == b"client" and not router.workers[b"A-worker"].inflight
