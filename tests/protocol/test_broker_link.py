"""The broker link (spec_serve/transport/broker_link.py) on its own, without sockets: the connection state
machine that the client's I/O thread and the worker's session share. Time is passed in, so each test walks
the link through heartbeats, a silent broker, a stop and a broker never reached, and reads what it logged."""

from __future__ import annotations

import logging

import pytest

from spec_serve.transport.broker_link import BrokerLink, Due

log = logging.getLogger("spec_serve.test_link")
URL = "tcp://broker:5555"


def _link(*, reconnect_unheard: bool = False, beat_at_once: bool = False) -> BrokerLink:
    # A heartbeat a second, lost after 3 silent seconds, fail fast after 10 s without an answer.
    return BrokerLink("client", URL, log, heartbeat_interval=1.0, liveness=3, connect_timeout=10.0, now=0.0,
                      reconnect_unheard=reconnect_unheard, beat_at_once=beat_at_once)


def _lines(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().split()[0] == name]


@pytest.fixture(autouse=True)
def _capture(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=log.name)


def test_heartbeats_come_every_interval():
    link = _link()
    assert link.tick(0.5) == Due()  # the first one interval in
    assert link.tick(1.0).beat and not link.tick(1.5).beat and link.tick(2.0).beat
    assert _link(beat_at_once=True).tick(0.0).beat


def test_a_broker_heard_never_expires():
    link = _link()
    link.connected(0.0)
    for t in range(1, 30):
        link.heard(float(t))
        assert not link.tick(float(t)).reconnect
    assert link.up


def test_silence_past_the_liveness_window_reconnects_and_logs_one_outage(caplog):
    link = _link()
    link.connected(0.0)
    assert not link.tick(3.0).reconnect  # exactly the window: not yet
    assert link.tick(3.1).reconnect and not link.up and link.lost_since == 3.1
    assert link.tick(6.2).reconnect and link.tick(9.3).reconnect  # still silent: a fresh socket each window
    assert _lines(caplog, "client.broker_lost") == [f"client.broker_lost broker={URL} silent_s=3.0"]
    assert link.connected(10.0)  # back: the outage ends, once
    assert _lines(caplog, "client.broker_regained") == [f"client.broker_regained broker={URL} after_s=6.9"]
    assert not link.connected(10.5) and len(_lines(caplog, "client.broker_regained")) == 1


def test_a_stopping_broker_starts_the_outage_at_once_and_silence_adds_no_line(caplog):
    link = _link()
    link.connected(0.0)
    link.stopping(1.0, pending=2)
    link.stopping(1.5)
    assert not link.up and link.lost_since == 1.0
    assert link.tick(5.0).reconnect
    assert _lines(caplog, "client.broker_stopping") == [f"client.broker_stopping broker={URL} pending=2"]
    assert _lines(caplog, "client.broker_lost") == []
    link.connected(6.0)
    assert _lines(caplog, "client.broker_regained") == [f"client.broker_regained broker={URL} after_s=5.0"]


def test_a_socket_that_never_reached_a_broker_is_replaced_only_if_asked():
    client, worker = _link(), _link(reconnect_unheard=True)
    assert not client.tick(3.5).reconnect  # libzmq keeps retrying the client's connect
    assert worker.tick(3.5).reconnect  # a worker registers again on a fresh socket


def test_fail_fast_once_when_no_broker_ever_answered(caplog):
    link = _link()
    assert not any(link.tick(t).unreachable for t in (1.0, 5.0, 10.0))
    assert link.tick(10.1).unreachable
    assert not link.tick(11.0).unreachable and not link.tick(50.0).unreachable  # once
    link.connected(60.0)
    assert _lines(caplog, "client.broker_reached") == [f"client.broker_reached broker={URL}"]
    link.heard(60.0)
    assert not link.tick(200.0).unreachable  # reached once: an outage now, never "unreachable"


def test_a_link_up_in_time_never_fails_fast():
    link = _link()
    link.connected(2.0)
    assert not link.tick(11.0).unreachable
