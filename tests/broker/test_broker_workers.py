"""``WorkerRegistry`` (broker/workers.py) without sockets: READY checks, the service's one target, and
removal with a reason."""

from __future__ import annotations

import logging
import time

import pytest

from broker_util import SERVICE, TARGET_INFO, Recorder, message
from spec_serve.broker.context import BrokerContext, Peer
from spec_serve.broker.services import ServiceQueues
from spec_serve.broker.state import RequestTable
from spec_serve.broker.workers import MAX_WORKER_CAPACITY, WorkerRegistry
from spec_serve.protocol.commands import WORKER_TAG, Message, ProtocolError, WorkerCommand
from spec_serve.protocol.messages import Ready


def make_registry() -> tuple[WorkerRegistry, Recorder]:
    recorder = Recorder()
    ctx = BrokerContext(recorder, heartbeat_interval=1.0, liveness=3)
    return WorkerRegistry(ctx, ServiceQueues(ctx, RequestTable())), recorder


def ready(info: dict | None = None, capacity: int = 1) -> tuple[Message, Ready]:
    """A READY message and its typed header, as the broker's loop hands them to ``register``."""
    msg = message(WORKER_TAG, WorkerCommand.READY, header={"target_info": info or TARGET_INFO, "capacity": capacity})
    return msg, Ready.from_json(msg.header)


def test_a_worker_registers_under_its_service_with_capped_capacity():
    registry, _ = make_registry()
    now = time.monotonic()
    worker = registry.register(b"worker-a", *ready(capacity=10**6), now, pinned=[])
    assert worker is not None and worker.capacity == MAX_WORKER_CAPACITY
    assert registry.services[SERVICE].workers == [b"worker-a"] and SERVICE in registry.services.served
    assert registry.serving_fingerprint(SERVICE) == TARGET_INFO["fingerprint"]
    assert registry.seen(b"worker-a", now + 1).expiry == now + 1 + registry.ctx.expiry_window
    assert registry.seen(b"stranger", now) is None


@pytest.mark.parametrize("info", [{"hidden_size": "eight"}, {**TARGET_INFO, "model_name": "x" * (9 << 10)}])
def test_junk_target_info_is_a_protocol_error(info):
    registry, _ = make_registry()
    with pytest.raises(ProtocolError, match="READY with"):
        registry.register(b"worker-a", *ready(info), time.monotonic(), pinned=[])
    assert not registry.workers


def test_a_worker_of_another_target_is_refused():
    registry, recorder = make_registry()
    now = time.monotonic()
    registry.register(b"worker-a", *ready(), now, pinned=[])
    other = {**TARGET_INFO, "hidden_size": 16, "fingerprint": "e" * 32}
    assert registry.register(b"worker-b", *ready(other), now, pinned=[]) is None
    [(peer, who, refused)] = recorder.take()
    assert (peer, who, refused.command) == (Peer.WORKER, b"worker-b", WorkerCommand.REFUSED.value)
    assert "hidden_size: serving=8 new=16" in refused.header["error"]
    assert list(registry.workers) == [b"worker-a"]


def test_with_no_worker_left_the_clients_pinned_target_decides():
    registry, recorder = make_registry()
    now = time.monotonic()
    other = {**TARGET_INFO, "fingerprint": "e" * 32}
    assert registry.register(b"worker-b", *ready(other), now, pinned=["f" * 32, "f" * 32]) is None
    [(_, _, refused)] = recorder.take()
    assert "2 connected client(s)" in refused.header["error"]
    assert registry.register(b"worker-a", *ready(), now, pinned=["f" * 32]) is not None


def test_removal_names_its_reason(caplog):
    registry, _ = make_registry()
    worker = registry.register(b"worker-a", *ready(), time.monotonic(), pinned=[])
    with caplog.at_level(logging.INFO, logger="spec_serve.broker"):
        service = registry.remove(worker, "left: draining")
    assert service.name == SERVICE and service.workers == [] and not registry.workers
    assert "broker.worker_gone" in caplog.text and "left: draining" in caplog.text
