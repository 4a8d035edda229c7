"""``ServiceQueues`` (broker/services.py) without sockets: fair queues per service and client, deadlines
of queued requests, and which service names the broker keeps."""

from __future__ import annotations

import time

from broker_util import SERVICE, Recorder
from spec_serve.broker.context import BrokerContext, Peer
from spec_serve.broker.services import ServiceQueues
from spec_serve.broker.state import Request, RequestTable
from spec_serve.protocol.commands import UNKNOWN_SERVICE_GRACE, ClientCommand, ErrorCode
from spec_serve.protocol.messages import SupervisionRequest


def make_queues() -> tuple[ServiceQueues, RequestTable, Recorder]:
    recorder = Recorder()
    requests = RequestTable()
    return ServiceQueues(BrokerContext(recorder, heartbeat_interval=1.0, liveness=3), requests), requests, recorder


def hold(queues: ServiceQueues, requests: RequestTable, client: bytes, name: str, now: float,
         deadline: float = 60.0, service: str = SERVICE) -> Request:
    queues.service(service, now)
    request = Request(name.encode().ljust(16, b"."), client, service,
                      SupervisionRequest(reply_to="tcp://127.0.0.1:9"), [], now + deadline, now)
    requests[request.request_id] = request
    queues.push(request)
    return request


def drain(queues: ServiceQueues) -> list[str]:
    taken = []
    while (picked := queues.next_request(queues[SERVICE], lambda r: True)) is not None:
        taken.append(picked[0].request_id.rstrip(b".").decode())
    return taken


def test_clients_take_turns_and_a_request_put_back_goes_first():
    queues, requests, _ = make_queues()
    now = time.monotonic()
    for name in ("a1", "a2", "a3"):
        hold(queues, requests, b"client-a", name, now)
    hold(queues, requests, b"client-b", "b1", now)
    assert drain(queues) == ["a1", "b1", "a2", "a3"]
    for name in ("a4", "a5"):
        hold(queues, requests, b"client-a", name, now)
    queues.push(requests[b"a3".ljust(16, b".")], front=True)
    assert drain(queues) == ["a3", "a4", "a5"]
    assert queues[SERVICE].queue_depth() == 0


def test_next_request_skips_what_the_caller_declines_and_forgotten_ids():
    queues, requests, _ = make_queues()
    now = time.monotonic()
    first = hold(queues, requests, b"client-a", "a1", now)
    hold(queues, requests, b"client-a", "a2", now)
    del requests[first.request_id]  # forgotten meanwhile (its client left)
    assert queues.next_request(queues[SERVICE], lambda r: False) is None
    assert queues[SERVICE].queue_depth() == 1  # the forgotten id went, the declined one stays
    assert drain(queues) == ["a2"]


def test_queued_requests_past_their_deadline_fail_with_timeout():
    queues, requests, recorder = make_queues()
    now = time.monotonic()
    queues.remember_served(SERVICE)
    late = hold(queues, requests, b"client-a", "late", now, deadline=1)
    hold(queues, requests, b"client-a", "fine", now, deadline=60)
    forgotten = []
    queues.expire(queues[SERVICE], now + 2, forgotten.append)
    assert forgotten == [late]
    [(peer, who, error)] = recorder.take()
    assert (peer, who, error.command, error.request_id) == (Peer.CLIENT, b"client-a", ClientCommand.ERROR.value,
                                                           late.request_id)
    assert error.header["code"] == ErrorCode.TIMEOUT.value
    assert queues[SERVICE].queue_depth() == 1


def test_a_service_no_worker_ever_served_fails_its_queue_after_the_grace():
    queues, requests, recorder = make_queues()
    now = time.monotonic()
    hold(queues, requests, b"client-a", "a1", now, service="typo")
    assert not queues.unknown("typo", now)  # workers may still be loading
    later = now + UNKNOWN_SERVICE_GRACE + 1
    assert queues.unknown("typo", later)
    queues.expire(queues["typo"], later, lambda r: None)
    [(_, _, error)] = recorder.take()
    assert error.header["code"] == ErrorCode.UNKNOWN_SERVICE.value and "'typo'" in error.header["error"]


def test_unused_services_are_forgotten_at_once_and_served_names_remembered():
    queues, requests, _ = make_queues()
    now = time.monotonic()
    for name in ("gone", "used", "queued"):
        queues.service(name, now)
        queues.remember_served(name)
    hold(queues, requests, b"client-a", "q1", now, service="queued")
    queues.forget_unused(in_use={"used"})
    assert sorted(queues.services) == ["queued", "used"]
    assert "gone" in queues.served and not queues.unknown("gone", now + 10 * UNKNOWN_SERVICE_GRACE)
