"""``BrokerReplies`` (client/broker_replies.py: what the client's I/O thread does with the broker's messages)
without sockets, in the style of tests/broker/test_broker_*.py: it gets the frames a broker would send, over the real
``Requests`` and a recording ``send``; the callbacks ClientIO gives it are recorded as events."""

from __future__ import annotations

import concurrent.futures
import logging

import torch

from spec_serve.client.broker_replies import BrokerReplies
from spec_serve.client.errors import RemoteError
from spec_serve.client.pending import Pending, Requests
from spec_serve.client.stats import ClientStats
from spec_serve.client.vocab import VocabRegistrations
from spec_serve.client.worker_replies import WorkerReplies
from spec_serve.paths.base import ClientSetup
from spec_serve.paths.registry import ClientPaths
from spec_serve.protocol.commands import (
    CLIENT_TAG,
    ClientCommand,
    ErrorCode,
    control,
    new_request_id,
    parse_control,
)
from spec_serve.protocol.messages import BrokerError, BrokerHeartbeat, SupervisionRequest
from spec_serve.transport.broker_link import BrokerLink

REPLY_TO = "tcp://127.0.0.1:9"
log = logging.getLogger("spec_serve.client")


class Parts:
    """A client's I/O-side parts wired as ClientIO wires them, around a recording ``send``."""

    def __init__(self, max_retries: int = 2):
        self.sent: list[list] = []
        self.stats = ClientStats()
        self.requests = Requests(self.sent.append, self.stats, max_retries, leave_binding=lambda rid, why: None)
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


class _NoPort:
    """The frames path's client half uses nothing of the I/O thread."""

    data_endpoint, data_key, local_host = REPLY_TO, None, "127.0.0.1"


def _from_broker(command: ClientCommand, request_id: bytes = b"", header=None) -> list:
    return control(CLIENT_TAG, command.value, "svc", request_id, header)


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


def test_being_forgotten_sends_everything_again_and_an_unknown_mapping_goes_behind_its_registration():
    parts = Parts(max_retries=0)
    parts.broker.on_control(_from_broker(ClientCommand.DISCONNECT))
    assert parts.events == ["answered", "resend_all"]  # the broker forgot us: mappings and requests again
    parts.vocab.record("d1", "svc", [b"mapping"])
    pending = parts.request(vocab="d1")
    parts.sent.clear()
    parts.broker.on_control(_from_broker(ClientCommand.ERROR, pending.request_id, BrokerError(
        code=ErrorCode.BAD_REQUEST.value, error="vocab mapping 'd1' is no longer registered", unknown_vocab=True)))
    sent = [parse_control(frames, CLIENT_TAG, ClientCommand) for frames in parts.sent]
    # The mapping first, then the request behind it on the same connection, at no cost to its retries.
    assert [m.command for m in sent] == [ClientCommand.SET_VOCAB.value, ClientCommand.REQUEST.value]
    assert sent[1].request_id == pending.request_id and pending.attempts == 1 and not pending.future.done()
