"""``Outbox`` and ``DataSockets`` (worker/replies.py) without sockets: a context whose PUSH sockets record
what they take, and trackers the test completes (as libzmq does once it let go of every frame of a reply).

Covered: DONE for each reply at once, in the order replies become ready (a device->host copy still running
waits); a reply's loan released exactly once, only after ZeroMQ let go of it (``left``) or when it is never
sent (``dropped``); a socket still connecting holds a reply for ``CONNECT_GRACE_S`` then makes it
undeliverable; a bad ``reply_to``; a stuck socket closed, which frees what its replies borrow.
"""

from __future__ import annotations

import collections
import re

import pytest
import zmq

from fakes.loan import CountingLoan
from spec_serve.paths.base import Outgoing
from spec_serve.protocol.commands import ErrorCode, Status, new_request_id, parse_data
from spec_serve.protocol.messages import Done, ErrorReply, Reply
from spec_serve.worker import replies
from spec_serve.worker.jobs import Job, Result
from spec_serve.worker.replies import CONNECT_GRACE_S, DATA_SOCKET_IDLE_S, MAX_DATA_SOCKETS, DataSockets, Outbox

ENDPOINT = "tcp://127.0.0.1:7001"
REPLY_TIMEOUT = 30.0


class Tracker:
    """A ``zmq.MessageTracker`` the test completes."""

    def __init__(self) -> None:
        self.done = False


class PushSocket:
    """A PUSH socket that takes replies (``taking``), or raises ``zmq.Again`` as a full or unconnected one does."""

    def __init__(self) -> None:
        self.options: dict[int, object] = {}
        self.endpoint: str | None = None
        self.taking = True
        self.sent: list[tuple[list, Tracker]] = []
        self.closed_with: int | None = None

    def setsockopt(self, option: int, value: object) -> None:
        self.options[option] = value

    def connect(self, endpoint: str) -> None:
        if not re.fullmatch(r"tcp://[\w.]+:\d+", endpoint):
            raise zmq.ZMQError(zmq.EINVAL)  # as libzmq refuses a malformed endpoint
        self.endpoint = endpoint

    def take(self, frames: list) -> Tracker:
        if not self.taking:
            raise zmq.Again()
        tracker = Tracker()
        self.sent.append((list(frames), tracker))
        return tracker

    def close(self, linger: int | None = None) -> None:
        """LINGER 0: libzmq drops what it still queues, so every tracker completes."""
        self.closed_with = linger
        for _, tracker in self.sent:
            tracker.done = True


class Context:
    def __init__(self) -> None:
        self.sockets: list[PushSocket] = []

    def socket(self, kind: int) -> PushSocket:
        assert kind == zmq.PUSH
        self.sockets.append(PushSocket())
        return self.sockets[-1]


class DeviceCopy:
    """A ``torch.cuda.Event`` stand-in: the reply's device->host copy, complete once ``finished``."""

    def __init__(self) -> None:
        self.finished = False

    def query(self) -> bool:
        return self.finished


class Harness:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(replies, "send_lent", lambda sock, frames, flags: sock.take(frames))
        self.ctx = Context()
        self.sockets = DataSockets(self.ctx, None, REPLY_TIMEOUT)  # type: ignore[arg-type]
        self.done: list[tuple[bytes, Done]] = []
        self.outbox = Outbox(self.sockets, lambda request_id, done: self.done.append((request_id, done)))

    def result(self, reply_to: str = ENDPOINT, loan: CountingLoan | None = None, ready: DeviceCopy | None = None,
               via: str = "frames", frames: list | None = None) -> Result:
        job = Job(new_request_id(), {"reply_to": reply_to}, [], 0.0)
        payload = [b"x" * 10, b"y" * 6] if frames is None else frames
        return Result(job, Status.OK, Outgoing(Reply(worker="w", compute_s=0.5), payload, via, ready, loan), tokens=7)

    def take_done(self) -> list[tuple[bytes, Done]]:
        done, self.done = self.done, []
        return done


@pytest.fixture
def h(monkeypatch):
    return Harness(monkeypatch)


def test_a_sent_reply_is_done_at_once_and_its_loan_goes_back_once_after_zeromq_let_go(h):
    loan = CountingLoan()
    result = h.result(loan=loan)
    h.outbox.add(result, now=0.0)
    assert h.outbox.busy and not h.outbox.empty
    h.outbox.flush(now=0.0)
    [(request_id, done)] = h.take_done()
    assert request_id == result.job.request_id
    assert done == Done(status="ok", tokens=7, nbytes=16, via="frames", error=None)
    [sock] = h.ctx.sockets
    [(frames, tracker)] = sock.sent
    status, sent_id, header, payload = parse_data(frames)
    assert (status, sent_id, header, payload) == (Status.OK, request_id, result.reply.to_json(), result.frames)
    assert h.outbox.served == 1 and h.outbox.replies == collections.Counter(frames=1)
    h.outbox.flush(now=1.0)
    assert loan.calls == [] and h.outbox.busy  # ZeroMQ still holds a frame: the slab stays lent
    tracker.done = True
    h.outbox.flush(now=2.0)
    h.outbox.flush(now=3.0)
    assert loan.calls == ["left"] and not h.outbox.busy
    assert h.take_done() == []  # DONE was told once


def test_replies_are_handed_over_as_their_device_copies_complete(h):
    copying = DeviceCopy()
    first, second = h.result(ready=copying), h.result(ready=DeviceCopy())
    second.out.ready.finished = True  # type: ignore[union-attr]
    for result in (first, second):
        h.outbox.add(result, now=0.0)
    h.outbox.flush(now=0.0)
    assert [rid for rid, _ in h.take_done()] == [second.job.request_id]  # the first's copy still runs
    assert not h.outbox.empty
    copying.finished = True
    h.outbox.flush(now=0.1)
    assert [rid for rid, _ in h.take_done()] == [first.job.request_id]
    [sock] = h.ctx.sockets
    assert [parse_data(frames)[1] for frames, _ in sock.sent] == [second.job.request_id, first.job.request_id]
    assert h.outbox.empty and h.outbox.served == 2


def test_a_socket_still_connecting_holds_the_reply_for_the_grace_then_it_is_undeliverable(h):
    loan = CountingLoan()
    result = h.result(loan=loan)
    h.outbox.add(result, now=0.0)
    [sock] = h.ctx.sockets
    sock.taking = False
    h.outbox.flush(now=0.0)
    h.outbox.flush(now=CONNECT_GRACE_S - 0.01)
    assert h.take_done() == [] and loan.calls == [] and not h.outbox.empty
    h.outbox.flush(now=CONNECT_GRACE_S + 0.01)
    [(request_id, done)] = h.take_done()
    assert (request_id, done.status) == (result.job.request_id, "undeliverable")
    assert done.error == "its data socket takes nothing (the endpoint refuses, or nothing reads it)"
    assert loan.calls == ["dropped"]
    assert h.outbox.replies == collections.Counter() and h.outbox.served == 1 and not h.outbox.busy


def test_a_socket_full_of_our_replies_holds_the_next_until_one_leaves_however_long_the_link_takes(h):
    """SNDHWM replies queued for a slow reader: the next waits (no DONE, its loan kept) past the grace, and goes
    once ZeroMQ let go of one; it was undeliverable before, so a deep prefetch over a slow link failed."""
    first, waiting = CountingLoan(), CountingLoan()
    h.outbox.add(h.result(loan=first), now=0.0)
    h.outbox.flush(now=0.0)
    [sock] = h.ctx.sockets
    assert len(h.take_done()) == 1
    sock.taking = False  # the queue is full
    result = h.result(loan=waiting)
    h.outbox.add(result, now=0.1)
    for now in (0.1, CONNECT_GRACE_S + 1, REPLY_TIMEOUT / 2):
        h.outbox.flush(now=now)
        h.sockets.close_idle(now=now)
    assert h.take_done() == [] and waiting.calls == [] and not h.outbox.empty
    sock.sent[0][1].done, sock.taking = True, True  # the first reply left: room again
    h.outbox.flush(now=REPLY_TIMEOUT / 2 + 0.1)
    [(request_id, done)] = h.take_done()
    assert (request_id, done.status) == (result.job.request_id, "ok") and first.calls == ["left"]
    assert len(sock.sent) == 2


def test_a_reply_to_no_socket_takes_is_undeliverable_at_once(h, caplog):
    loan = CountingLoan()
    result = h.result(reply_to="tcp://127.0.0.1:port", loan=loan)
    h.outbox.add(result, now=0.0)
    [(request_id, done)] = h.take_done()
    assert (request_id, done.status) == (result.job.request_id, "undeliverable")
    assert done.error is not None and done.error.startswith("bad endpoint: ") and "\n" not in done.error
    assert loan.calls == ["dropped"] and not h.outbox.busy
    assert h.ctx.sockets[0].closed_with == 0  # make_socket closes a socket it could not connect
    assert "worker.bad_reply_to" in caplog.text


def test_a_stuck_data_socket_is_closed_and_what_its_replies_borrow_goes_back(h, caplog):
    """A client that stopped reading: its socket's oldest reply has not left within ``reply_timeout``."""
    loans = [CountingLoan(), CountingLoan()]
    for loan in loans:
        h.outbox.add(h.result(loan=loan), now=0.0)
    h.outbox.flush(now=0.0)
    h.sockets.close_idle(now=REPLY_TIMEOUT)
    assert h.sockets.unsent(REPLY_TIMEOUT) == 2 and h.ctx.sockets[0].closed_with is None
    h.sockets.close_idle(now=REPLY_TIMEOUT + 0.1)
    assert h.ctx.sockets[0].closed_with == 0 and "worker.reply_stuck" in caplog.text
    h.outbox.flush(now=REPLY_TIMEOUT + 0.2)
    assert [loan.calls for loan in loans] == [["left"], ["left"]] and not h.outbox.busy
    assert h.sockets.unsent(REPLY_TIMEOUT + 0.2) == 0
    h.outbox.add(h.result(), now=REPLY_TIMEOUT + 0.3)  # the next reply to that client gets a new socket
    assert len(h.ctx.sockets) == 2


def test_a_reply_waiting_on_a_socket_closed_meanwhile_is_undeliverable(h):
    loan = CountingLoan()
    h.outbox.add(h.result(loan=loan), now=0.0)
    h.sockets.close_all(linger_ms=0)
    h.outbox.flush(now=0.0)
    [(_, done)] = h.take_done()
    assert done.status == "undeliverable" and loan.calls == ["dropped"] and h.ctx.sockets[0].sent == []


@pytest.mark.parametrize("code,status", [(ErrorCode.ENGINE_DEAD, "engine_dead"), (ErrorCode.INTERNAL, "error"),
                                         (ErrorCode.BAD_REQUEST, "error")])
def test_an_error_reply_is_sent_and_done_names_its_status(h, code, status):
    result = h.result(frames=[])
    result.status, result.out.reply = Status.ERROR, ErrorReply(worker="w", code=code.value, error="why")
    h.outbox.add(result, now=0.0)
    h.outbox.flush(now=0.0)
    [(_, done)] = h.take_done()
    assert (done.status, done.nbytes) == (status, 0)
    [(frames, _)] = h.ctx.sockets[0].sent
    assert parse_data(frames)[0] is Status.ERROR


def test_replies_are_counted_by_path(h):
    for via in ("frames", "plane", "frames"):
        h.outbox.add(h.result(via=via), now=0.0)
    h.outbox.flush(now=0.0)
    assert h.outbox.replies == collections.Counter(frames=2, plane=1)
    assert [d.via for _, d in h.take_done()] == ["frames", "plane", "frames"]


# ------------------------------------------------------------ DataSockets


def test_one_socket_per_client_endpoint_configured_for_replies(h):
    first = h.sockets.get(ENDPOINT, None, now=0.0)
    assert h.sockets.get(ENDPOINT, None, now=1.0) is first and first.used == 1.0
    [sock] = h.ctx.sockets
    assert sock.endpoint == ENDPOINT
    assert sock.options[zmq.SNDHWM] == replies.DATA_SOCKET_HWM and sock.options[zmq.IMMEDIATE] == 1


def test_at_most_max_data_sockets_the_least_recently_used_closed_first(h):
    for port in range(MAX_DATA_SOCKETS):
        h.sockets.get(f"tcp://127.0.0.1:{8000 + port}", None, now=float(port))
    h.sockets.get("tcp://127.0.0.1:8000", None, now=100.0)  # used again: now the newest
    h.sockets.get("tcp://127.0.0.1:9999", None, now=101.0)
    closed = [sock.endpoint for sock in h.ctx.sockets if sock.closed_with is not None]
    assert closed == ["tcp://127.0.0.1:8001"]


def test_an_idle_data_socket_is_closed(h):
    h.sockets.get(ENDPOINT, None, now=0.0)
    h.sockets.close_idle(now=DATA_SOCKET_IDLE_S - 1)
    assert h.ctx.sockets[0].closed_with is None
    h.sockets.close_idle(now=DATA_SOCKET_IDLE_S + 1)
    assert h.ctx.sockets[0].closed_with == 0
