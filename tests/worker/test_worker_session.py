"""``BrokerSession`` (worker/session.py) without a broker, in the style of tests/broker/test_broker_*.py: the broker's
commands as parsed messages, registration through the broker link, and what the session would have sent
(its DEALER is a recorder)."""

from __future__ import annotations

import logging

import pytest
import zmq

from spec_serve.protocol.commands import (
    WORKER_TAG,
    WorkerCommand,
    control,
    parse_control,
)
from spec_serve.protocol.messages import Disconnect, Refused
from spec_serve.supervision.target_info import TargetInfo
from spec_serve.worker.session import BrokerSession, WorkerRefused


class _Recording:
    """The session's DEALER, as far as these tests need it: what it was given to send."""

    def __init__(self):
        self.sent: list[list] = []

    def send_multipart(self, frames, *args, **kwargs) -> None:
        self.sent.append(frames)


def _session(handlers=None) -> BrokerSession:
    info = TargetInfo(num_hidden_layers=2, hidden_size=8, vocab_size=32, aux_layer_ids=[0, 1], dspark_layer_ids=[1],
                      model_name="tiny", dtype="float32", engine="fake", fingerprint="f" * 32)
    session = BrokerSession(zmq.Context.instance(), b"w" * 16, "w0", "tcp://127.0.0.1:1", "svc", security=None,
                            info=info, capacity=1, max_message_bytes=1 << 20, heartbeat_interval=1.0, liveness=3,
                            handlers=handlers or {}, before_ready=lambda: True)
    session.sock = _Recording()  # type: ignore[assignment]
    return session


def _message(command: WorkerCommand, header=None):
    return parse_control(control(WORKER_TAG, command.value, "svc", b"", header), WORKER_TAG, WorkerCommand)


def test_the_session_registers_serves_and_hears_the_broker_stop(caplog):
    caplog.set_level(logging.INFO, logger="spec_serve.worker")
    served = []
    session = _session({WorkerCommand.REQUEST: served.append})
    session._send_ready()
    [ready] = session.sock.sent
    assert parse_control(ready, WORKER_TAG, WorkerCommand).header["host_key"]  # locality: where this worker runs
    assert not session.registered
    assert session._dispatch(_message(WorkerCommand.REQUEST)) is False and len(served) == 1
    session._on_registered()
    assert session.registered and any("worker.ready" in r.getMessage() for r in caplog.records)
    assert session._dispatch(_message(WorkerCommand.DISCONNECT, Disconnect(stopping=True))) is True  # READY again
    assert not session.registered and session.link.lost_since is not None
    session._on_registered()
    assert [r.getMessage().split()[0] for r in caplog.records].count("worker.broker_regained") == 1


def test_a_refusal_ends_the_session():
    with pytest.raises(WorkerRefused, match="another target"):
        _session()._dispatch(_message(WorkerCommand.REFUSED, Refused(error="served by another target")))
