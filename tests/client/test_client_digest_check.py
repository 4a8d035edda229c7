"""``DigestCheck`` (client/integrity.py) without sockets: landed tensors against the digests a worker sent,
a recording ``resubmit``, and the real ``ClientPaths`` with ``Pin``, a test path that pins a request to one
worker and lets go of it when the request must go elsewhere.

Covered: a request without ``verify`` is not checked; matching bytes pass; a mismatch retries once on another
worker (named in ``avoid``, the pin let go, counted, logged at ERROR); a second mismatch of the same request
raises ``IntegrityError`` naming both workers, without a third attempt; each request of a batch is retried
on its own.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from typing import ClassVar

import pytest
import torch

from spec_serve.client.errors import IntegrityError
from spec_serve.client.integrity import DigestCheck
from spec_serve.client.received import Received
from spec_serve.client.stats import ClientStats
from spec_serve.paths.base import ClientSetup, ClientSide, ReplyPath
from spec_serve.paths.frames import FramesPath
from spec_serve.paths.registry import ClientPaths
from spec_serve.protocol import digest
from spec_serve.protocol.commands import new_request_id
from spec_serve.protocol.messages import Reply, SupervisionRequest
from spec_serve.supervision.contract import Expected
from spec_serve.telemetry.metrics import CLIENT_INTEGRITY_FAILURES

SERVICE = "digest-check-svc"


class PinSide(ClientSide):
    """Pins a request to our own worker with ``offers["pin"]``; ``elsewhere`` lets go of it."""

    name: ClassVar[str] = "pin"

    def __init__(self) -> None:
        self.let_go: list[str] = []

    def carries(self, reply: Reply) -> bool:
        return False

    def elsewhere(self, request: SupervisionRequest, reason: str) -> SupervisionRequest:
        if not (request.offers or {}).get(self.name):
            return request
        self.let_go.append(reason)
        return dataclasses.replace(request, offers=None)


class PinPath(ReplyPath):
    name: ClassVar[str] = "pin"
    side = PinSide()

    @classmethod
    def worker(cls, setup):
        return None

    @classmethod
    def client(cls, setup: ClientSetup) -> ClientSide:
        return cls.side


class Harness:
    def __init__(self, *requests: SupervisionRequest) -> None:
        PinPath.side = self.pin = PinSide()
        self.paths = ClientPaths(ClientSetup(None, SERVICE, torch.device("cpu"), {}),  # type: ignore[arg-type]
                                 [PinPath, FramesPath])
        self.resubmitted: list[tuple[SupervisionRequest, list, Expected]] = []
        self.stats = ClientStats()
        self.payloads = [[f"payload {k}".encode()] for k in range(len(requests))]
        self.expects = [Expected({"t": (torch.float32, (2,))}) for _ in requests]
        self.check = DigestCheck([(r, p) for r, p in zip(requests, self.payloads)], self.expects, self.resubmit,
                                 self.stats, SERVICE, self.paths)

    def resubmit(self, header: SupervisionRequest, payload, expected: Expected) -> concurrent.futures.Future:
        self.resubmitted.append((header, payload, expected))
        return concurrent.futures.Future()


def request(verify: bool = True, **fields) -> SupervisionRequest:
    return SupervisionRequest(reply_to="tcp://127.0.0.1:9", verify=verify, **fields)


LANDED = {"t": torch.tensor([1.0, 2.0]), "u": torch.tensor([3, 4], dtype=torch.int8)}


def reply(worker: str, landed: dict[str, torch.Tensor] = LANDED) -> Received:
    """A reply whose worker digested ``landed`` (what it computed)."""
    return Received(new_request_id(), Reply(worker=worker, digests=digest.digests([landed])[0]))


CHANGED = {**LANDED, "t": torch.tensor([1.0, 2.5])}  # what landed here after one word changed on the way


def digest_failures() -> float:
    return CLIENT_INTEGRITY_FAILURES.labels(service=SERVICE, check="digest")._value.get()


def test_a_request_without_verify_is_not_checked():
    h = Harness(request(verify=False))
    assert h.check(0, reply("w1"), CHANGED) is None
    assert h.stats.digest_checks == 0 and h.resubmitted == []


def test_bytes_that_landed_as_digested_pass():
    h = Harness(request())
    assert h.check(0, reply("w1"), LANDED) is None
    assert (h.stats.digest_checks, h.stats.digest_mismatches) == (1, 0)


def test_a_mismatch_is_retried_once_elsewhere_with_its_payload_and_expectation(caplog):
    h = Harness(request(offers={"pin": True}))
    before = digest_failures()
    with caplog.at_level(logging.ERROR, logger="spec_serve.client"):
        retry = h.check(0, reply("w1"), CHANGED)
    [(header, payload, expected)] = h.resubmitted
    assert isinstance(retry, concurrent.futures.Future)
    assert header == request(avoid="w1") and payload is h.payloads[0] and expected is h.expects[0]
    assert h.pin.let_go == ["digest mismatch in a reply from worker w1"]
    assert h.check.requests[0] == (header, payload)  # the next check of request 0 is of the retry
    assert (h.stats.digest_checks, h.stats.digest_mismatches) == (1, 1) and digest_failures() == before + 1
    assert "client.digest_mismatch" in caplog.text and "tensors=t" in caplog.text and "retry=True" in caplog.text


def test_a_second_mismatch_raises_naming_both_workers_without_a_third_attempt(caplog):
    h = Harness(request())
    h.check(0, reply("w1"), CHANGED)
    second = reply("w2")
    with pytest.raises(IntegrityError) as failed:
        h.check(0, second, CHANGED)
    message = str(failed.value)
    assert message == (f"reply to request {second.request_id.hex()[:12]} differs from its worker's digest in t on the "
                       f"retry too (first from worker w1, then from worker w2): the bytes change between the worker's "
                       f"device and ours; see the ERROR lines client.digest_mismatch")
    assert len(h.resubmitted) == 1 and h.stats.digest_mismatches == 2 and "retry=False" in caplog.text


def test_the_retry_that_lands_intact_passes():
    h = Harness(request())
    h.check(0, reply("w1"), CHANGED)
    assert h.check(0, reply("w2"), LANDED) is None and len(h.resubmitted) == 1


def test_each_request_of_a_batch_gets_its_own_retry():
    h = Harness(request(), request(), request())
    h.check(0, reply("w1"), CHANGED)
    assert h.check(1, reply("w1"), LANDED) is None
    h.check(2, reply("w2"), CHANGED)
    assert [header.avoid for header, _, _ in h.resubmitted] == ["w1", "w2"]
    assert [payload for _, payload, _ in h.resubmitted] == [h.payloads[0], h.payloads[2]]


def test_a_reply_without_digests_mismatches_every_tensor():
    h = Harness(request())
    h.check(0, Received(new_request_id(), Reply(worker="w1")), LANDED)
    assert h.stats.digest_mismatches == 1 and len(h.resubmitted) == 1
