"""The client's parts without sockets (in the style of tests/test_broker_*.py): ``Requests`` (pending.py: the
retry policy), ``BrokerReplies`` (what ClientIO does with the broker's messages), ``WorkerReplies`` (workers'
data messages to the requests they answer) and ``DigestCheck`` (integrity.py). Each gets the frames a peer
would send and a recording ``send``; real reply paths (frames, the NCCL path's client half with no binding)
read the data messages."""

from __future__ import annotations

import concurrent.futures
import logging

import pytest
import torch

from spec_serve.client.assembly import materialize
from spec_serve.client.broker_replies import BrokerReplies
from spec_serve.client.errors import IntegrityError, RemoteError
from spec_serve.client.integrity import DigestCheck
from spec_serve.client.pending import Pending, Requests
from spec_serve.client.received import Received
from spec_serve.client.stats import ClientStats
from spec_serve.client.vocab import VocabRegistrations
from spec_serve.client.worker_replies import WorkerReplies
from spec_serve.paths.base import ClientSetup
from spec_serve.paths.registry import ClientPaths
from spec_serve.protocol import digest, wire
from spec_serve.protocol.commands import (
    CLIENT_TAG,
    ClientCommand,
    ErrorCode,
    Status,
    control,
    data_message,
    new_request_id,
    parse_control,
)
from spec_serve.protocol.messages import BrokerError, BrokerHeartbeat, ErrorReply, Reply, SupervisionRequest
from spec_serve.supervision.contract import Expected
from spec_serve.transport.broker_link import BrokerLink

REPLY_TO = "tcp://127.0.0.1:9"
log = logging.getLogger("spec_serve.client")


class Parts:
    """A client's I/O-side parts wired as ClientIO wires them, around a recording ``send``."""

    def __init__(self, max_retries: int = 2):
        self.sent: list[list] = []
        self.stats = ClientStats()
        self.left: list[tuple[bytes, str]] = []
        self.requests = Requests(self.sent.append, self.stats, max_retries,
                                 leave_binding=lambda rid, why: self.left.append((rid, why)))
        self.vocab = VocabRegistrations()
        self.replies = WorkerReplies(self.requests, self.stats, 1 << 20, lambda fn: fn(), self.add)
        self.replies.paths = ClientPaths(ClientSetup(_NoPort(), "svc", torch.device("cpu"), {}),
                                         ("spec_serve.paths.frames:FramesPath",))
        self.link = BrokerLink("client", "tcp://broker:5555", log, heartbeat_interval=1.0, liveness=3,
                               connect_timeout=10.0, now=0.0, reconnect_unheard=False)
        self.events: list[str] = []
        self.broker = BrokerReplies(self.link, self.requests, self.vocab, self.replies,
                                    answered=lambda: self.events.append("answered"),
                                    misdirected=lambda e: self.events.append(f"misdirected: {e}"),
                                    resend_all=lambda: self.events.append("resend_all"), send=self.sent.append)

    def add(self, pending: Pending) -> None:
        self.requests.add(pending, 0.0)

    def request(self, timeout: float = 5.0, **header) -> Pending:
        pending = Pending(new_request_id(), ClientCommand.REQUEST.value, "svc",
                          SupervisionRequest(reply_to=REPLY_TO, **header), [], concurrent.futures.Future(), timeout)
        self.add(pending)
        return pending

    def sent_ids(self) -> list[bytes]:
        return [parse_control(frames, CLIENT_TAG, ClientCommand).request_id for frames in self.sent]


class _NoPort:
    """The frames path's client half uses nothing of the I/O thread."""

    data_endpoint, data_key, local_host = REPLY_TO, None, "127.0.0.1"


def _from_broker(command: ClientCommand, request_id: bytes = b"", header=None) -> list:
    return control(CLIENT_TAG, command.value, "svc", request_id, header)


# ------------------------------------------------------------------ Requests


def test_a_request_times_out_retries_then_fails_naming_its_attempts():
    parts = Parts(max_retries=1)
    pending = parts.request(timeout=5.0)
    parts.requests.check_timers(4.0)
    assert parts.sent_ids() == [pending.request_id]  # not yet
    parts.requests.check_timers(5.5)
    assert parts.sent_ids() == [pending.request_id] * 2 and parts.stats.retried == 1
    parts.requests.check_timers(11.0)
    with pytest.raises(TimeoutError, match="failed after 2 attempts: no reply within 5s"):
        pending.future.result(0)
    assert not parts.requests.table


def test_resend_all_costs_no_attempt_and_a_pinned_request_leaves_its_worker():
    parts = Parts(max_retries=0)
    plain, pinned = parts.request(), parts.request(pin="w1")
    parts.requests.resend_all(1.0)
    assert parts.sent_ids() == [plain.request_id, pinned.request_id] * 2 and plain.attempts == 1
    parts.requests.retry(pinned, 2.0, "its worker is gone")
    assert parts.left == [(pinned.request_id, "its worker is gone")] and not pinned.future.done()
    parts.requests.retry(plain, 2.0, "boom")  # no retries left: fails
    assert isinstance(plain.future.exception(0), TimeoutError)


# ------------------------------------------------------------------ BrokerReplies


def test_broker_errors_retry_or_fail_by_their_code():
    parts = Parts()
    retried, bad, killed = parts.request(), parts.request(), parts.request()
    for pending, code in ((retried, ErrorCode.UNAVAILABLE), (bad, ErrorCode.BAD_REQUEST),
                          (killed, ErrorCode.KILLED_WORKERS)):
        parts.broker.on_control(_from_broker(ClientCommand.ERROR, pending.request_id,
                                             BrokerError(code=code.value, error=f"{code.value} here")))
    assert retried.resend_at is not None and not retried.future.done()  # backing off, then again
    assert isinstance(bad.future.exception(0), ValueError) and "bad_request here" in str(bad.future.exception(0))
    assert isinstance(killed.future.exception(0), RemoteError)
    assert parts.events == ["answered"] * 3


def test_a_new_broker_instance_means_everything_again_and_stopping_starts_an_outage():
    parts = Parts()
    parts.link.connected(0.0)
    parts.broker.on_control(_from_broker(ClientCommand.HEARTBEAT, header=BrokerHeartbeat("b1")))
    parts.broker.on_control(_from_broker(ClientCommand.HEARTBEAT, header=BrokerHeartbeat("b1")))
    assert "resend_all" not in parts.events
    parts.broker.on_control(_from_broker(ClientCommand.HEARTBEAT, header=BrokerHeartbeat("b1", stopping=True)))
    assert not parts.link.up and parts.link.lost_since is not None
    parts.broker.on_control(_from_broker(ClientCommand.HEARTBEAT, header=BrokerHeartbeat("b2")))
    assert parts.events.count("resend_all") == 1


def test_the_workers_port_answering_means_misdirected_not_answered():
    parts = Parts()
    parts.broker.on_control(_from_broker(ClientCommand.ERROR, header=BrokerError(
        code=ErrorCode.WRONG_PORT.value, error="this is the workers' port")))
    assert parts.events == ["misdirected: tcp://broker:5555: this is the workers' port"]


# ------------------------------------------------------------------ WorkerReplies


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(2, 3, generator=torch.Generator().manual_seed(seed))}


def test_a_frames_reply_resolves_its_request_and_a_second_one_counts_as_a_duplicate():
    parts = Parts()
    pending = parts.request()
    frames = data_message(Status.OK, pending.request_id, Reply(worker="w0"), wire.encode(_tensors(1)))
    parts.replies.on_data(frames)
    received = pending.future.result(0)
    assert torch.equal(materialize(received.tensors, torch.device("cpu"))["x"], _tensors(1)["x"])
    parts.replies.on_data(frames)
    assert (parts.stats.replies["frames"], parts.stats.duplicates, parts.stats.unknown) == (1, 1, 0)


def test_a_workers_error_fails_or_retries_by_its_code():
    parts = Parts()
    bad, busy = parts.request(), parts.request()
    for pending, code in ((bad, ErrorCode.BAD_REQUEST), (busy, ErrorCode.INTERNAL)):
        parts.replies.on_data(data_message(Status.ERROR, pending.request_id,
                                           ErrorReply(worker="w0", code=code.value, error="no")))
    assert isinstance(bad.future.exception(0), ValueError) and "worker w0: no" in str(bad.future.exception(0))
    assert not busy.future.done() and busy.resend_at is not None


# ------------------------------------------------------------------ DigestCheck


def test_a_digest_mismatch_is_asked_again_avoiding_that_worker_and_twice_is_an_error():
    parts = Parts()
    request = SupervisionRequest(reply_to=REPLY_TO, verify=True)
    resent: list[SupervisionRequest] = []

    def resubmit(header, payload, expect) -> concurrent.futures.Future:
        resent.append(header)
        return concurrent.futures.Future()

    check = DigestCheck([(request, [])], [Expected({})], resubmit, parts.stats, "svc", parts.replies.paths)
    landed = _tensors(2)
    right = digest.digests([landed])[0]
    assert check(0, Received(b"r" * 16, Reply(worker="w0", digests=right)), landed) is None
    wrong = {"x": (right["x"] + 1) % (1 << 32)}
    assert check(0, Received(b"r" * 16, Reply(worker="w0", digests=wrong)), landed) is not None
    assert [r.avoid for r in resent] == ["w0"] and parts.stats.digest_mismatches == 1
    with pytest.raises(IntegrityError, match="on the retry too"):
        check(0, Received(b"s" * 16, Reply(worker="w1", digests=wrong)), landed)
