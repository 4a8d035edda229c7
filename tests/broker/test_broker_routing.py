"""The broker's routing decisions end to end through ``Router`` (all its parts together), driven without
sockets: the router's ``send`` is a recorder (tests/broker_util.py), and each test asserts on the messages
it would have put on the wire. Each part also has its own tests (tests/broker/test_broker_*.py)."""

from __future__ import annotations

import ast
import graphlib
import time
from pathlib import Path

import pytest

import spec_serve.broker
from broker_util import SERVICE, done, handle, make_router, ready, submit
from spec_serve.broker.context import Peer
from spec_serve.broker.routing import Router
from spec_serve.broker.status import full_status
from spec_serve.protocol.commands import WORKER_TAG, ClientCommand, ErrorCode, WorkerCommand


@pytest.fixture
def router():
    return make_router()


def test_a_request_goes_to_the_idle_worker(router):
    now = time.monotonic()
    ready(router, b"worker-a", now)
    ready(router, b"worker-b", now)
    first = submit(router, b"client", now)
    busy = next(w for w in (b"worker-a", b"worker-b") if router.recorder.requests_to(w) == [first])
    idle = b"worker-b" if busy == b"worker-a" else b"worker-a"
    router.recorder.take()
    second = submit(router, b"client", now)
    assert router.recorder.requests_to(idle) == [second]
    assert router.recorder.requests_to(busy) == []
    sent = router.recorder.take()
    assert sent[0][2].header["client"] == b"client".hex()  # the worker learns whom to reply to


def test_a_request_waits_in_the_queue_until_a_worker_is_free(router):
    now = time.monotonic()
    ready(router, b"worker-a", now)
    first = submit(router, b"client", now)
    second = submit(router, b"client", now)
    assert router.recorder.requests_to(b"worker-a") == [first]
    assert router.services[SERVICE].queue_depth() == 1
    router.recorder.take()
    done(router, b"worker-a", first, now)
    assert router.recorder.requests_to(b"worker-a") == [second]
    assert router.services[SERVICE].queue_depth() == 0


def test_a_dead_workers_request_goes_to_another(router):
    now = time.monotonic()
    ready(router, b"worker-a", now)
    request_id = submit(router, b"client", now)
    assert router.recorder.requests_to(b"worker-a") == [request_id]
    later = now + router.expiry_window / 2
    ready(router, b"worker-b", later)
    router.client_seen(b"client", later)
    router.recorder.take()
    router.purge(now + router.expiry_window + 0.1)  # worker-a has been silent too long; b has not
    assert b"worker-a" not in router.workers
    assert router.recorder.requests_to(b"worker-b") == [request_id]
    assert not [m for peer, _, m in router.recorder.sent if peer is Peer.CLIENT
                and m.command == ClientCommand.ERROR.value]


def test_a_queued_request_past_its_deadline_times_out(router):
    now = time.monotonic()
    ready(router, b"worker-a", now)
    submit(router, b"client", now, timeout=60)
    late = submit(router, b"client", now, timeout=2)
    router.recorder.take()
    later = now + 3
    router.worker_seen(b"worker-a", later)
    router.client_seen(b"client", later)
    router.purge(later)
    errors = [(who, m) for peer, who, m in router.recorder.take()
              if peer is Peer.CLIENT and m.command == ClientCommand.ERROR.value]
    assert [(who, m.request_id, m.header["code"]) for who, m in errors] == [
        (b"client", late, ErrorCode.TIMEOUT.value)]
    assert late not in router.requests


def test_a_worker_holding_a_request_past_its_timeout_loses_it_to_another(router):
    now = time.monotonic()
    ready(router, b"worker-a", now)
    request_id = submit(router, b"client", now, timeout=2)
    ready(router, b"worker-b", now)
    router.recorder.take()
    later = time.monotonic() + 3
    for worker in (b"worker-a", b"worker-b"):
        router.worker_seen(worker, later)
    router.client_seen(b"client", later)
    router.purge(later)
    assert router.recorder.requests_to(b"worker-b") == [request_id]
    assert router.requests[request_id].missed == {b"worker-a"}
    # worker-a answering late changes nothing: the request is worker-b's now
    done(router, b"worker-a", request_id, later)
    assert router.requests[request_id].worker == b"worker-b"


def leave(router: Router, worker: bytes, now: float, reason: str, drain: bool = False) -> None:
    header = {"reason": reason, "drain": True} if drain else {"reason": reason}
    handle(router.worker_left, router.worker_seen(worker, now), now, WORKER_TAG, WorkerCommand.LEAVE, header=header)


def test_a_draining_worker_gets_nothing_more_and_what_it_returns_goes_to_another(router):
    """Issue 23: a worker told to stop LEAVEs with drain (no more requests), returns what it never ran
    (DONE returned: at once to another worker), finishes the rest and LEAVEs for good: no death."""
    now = time.monotonic()
    ready(router, b"worker-a", now, capacity=2)
    running, queued = submit(router, b"client", now), submit(router, b"client", now)
    assert router.recorder.requests_to(b"worker-a") == [running, queued]
    ready(router, b"worker-b", now, capacity=1)
    router.recorder.take()
    leave(router, b"worker-a", now, "SIGTERM", drain=True)
    assert router.workers[b"worker-a"].free == 0
    page = full_status(router)
    assert sorted(w["state"] for w in page["workers"]) == ["idle", "leaving"]  # b idle, a draining
    assert page["services"][SERVICE]["ready_workers"] == 1
    newer = submit(router, b"client", now)
    assert router.recorder.requests_to(b"worker-b") == [newer] and router.recorder.requests_to(b"worker-a") == []
    router.recorder.take()
    handle(router.complete, router.worker_seen(b"worker-a", now), now, WORKER_TAG, WorkerCommand.DONE, queued,
           {"status": "returned"})
    assert router.services[SERVICE].queue_depth() == 1  # worker-b is busy: first in line for it
    done(router, b"worker-b", newer, now)
    assert router.recorder.requests_to(b"worker-b") == [queued]
    done(router, b"worker-a", running, now)
    leave(router, b"worker-a", now, "stopped: drained")
    assert b"worker-a" not in router.workers
    assert _sample(router, "spec_serve_worker_deaths_total") == 0
    assert _sample(router, "spec_serve_redispatched_total") == 1
    assert _sample(router, "spec_serve_completed_total", service=SERVICE, status="ok") == 2


def test_an_engine_death_leave_still_counts_as_a_death(router):
    now = time.monotonic()
    ready(router, b"worker-a", now)
    request_id = submit(router, b"client", now)
    ready(router, b"worker-b", now)
    router.recorder.take()
    leave(router, b"worker-a", now, "CUDA error")
    assert router.recorder.requests_to(b"worker-b") == [request_id]
    assert _sample(router, "spec_serve_worker_deaths_total") == 1


def _sample(router: Router, name: str, **labels: str) -> float:
    return router.metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_service_nobody_uses_is_forgotten_once_its_workers_are_gone(router):
    """A stray READY under a junk name: the service exists while its worker is registered, nobody uses it,
    and it goes with its worker (the old broker kept it for an idle grace of 60 s)."""
    now = time.monotonic()
    ready(router, b"worker-a", now)
    ready(router, b"junk-wkr", now, service="junk")
    submit(router, b"client", now)
    services = full_status(router)["services"]
    assert (services[SERVICE]["in_use"], services["junk"]["in_use"]) == (True, False)
    later = now + router.expiry_window + 0.1
    router.worker_seen(b"worker-a", later)
    router.client_seen(b"client", later)
    router.purge(later)
    assert "junk" not in router.services and "junk" in router.served
    assert SERVICE in router.services


def test_a_service_a_client_named_goes_with_the_client(router):
    now = time.monotonic()
    ready(router, b"worker-a", now)
    request_id = submit(router, b"client", now, service="typo")
    assert router.services["typo"].queue_depth() == 1
    router.client_seen(b"client", now)
    router.purge(now)
    assert "typo" in router.services  # its request is queued (until the unknown-service grace)
    router.delete_client(b"client")
    router.purge(now)
    assert "typo" not in router.services and request_id not in router.requests


def test_the_broker_modules_import_one_another_without_a_cycle():
    """Each part imports only those before it (docs/ARCHITECTURE.md gives the order), counting imports made
    for type checking only: Router once imported binding.py, and binding.py imported Router."""
    folder = Path(spec_serve.broker.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in folder.glob("*.py"):
        tree = ast.parse(path.read_text())
        graph[path.stem] = {node.module.rpartition(".")[2] for node in ast.walk(tree)
                            if isinstance(node, ast.ImportFrom) and node.module
                            and node.module.startswith("spec_serve.broker.")}
    order = list(graphlib.TopologicalSorter(graph).static_order())  # raises CycleError on a cycle
    assert order.index("context") < order.index("routing") and "binding" in graph["routing"]
