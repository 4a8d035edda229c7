"""``WorkerReplies`` (client/worker_replies.py) without sockets: data messages as a worker builds them, handed
to ``on_data``; the real ``Requests`` over a recording ``send``; the real ``ClientPaths`` with frames and two
test paths: ``Lent`` (a reply that borrows memory: counted ``discard`` and ``release``) and ``Follow`` (its
tensors follow the header on another channel).

Covered: a reply resolving its request (counted by path, batched, compact); late and unknown replies counted
apart and what they lend given back; each error code's fate (fail, fail without retry, back off); a reply
over the size limit or from another target failed and discarded; a reply breaking the contract released and
retried; a path's own re-request (new id, without the path, no attempt used) and fallback; a pinned request
back to the pool; tensors that follow.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any, ClassVar

import pytest
import torch

from spec_serve.client.errors import RemoteError, TargetChangedError
from spec_serve.client.pending import RETRY_BACKOFF_S, Pending, Requests
from spec_serve.client.stats import ClientStats
from spec_serve.client.worker_replies import WorkerReplies
from spec_serve.paths.base import Arrival, ClientSetup, ClientSide, LentReply, ReplyPath
from spec_serve.paths.frames import FramesPath
from spec_serve.paths.registry import ClientPaths
from spec_serve.protocol import wire
from spec_serve.protocol.commands import ClientCommand, ErrorCode, Status, data_message, new_request_id
from spec_serve.protocol.messages import BindGrant, BindRequest, ErrorReply, Reply, SupervisionRequest
from spec_serve.supervision.contract import Expected, Kind

MAX_BYTES = 1 << 16
FINGERPRINT = "f" * 32
TENSORS = {"t": torch.tensor([1.0, 2.0])}
EXPECT = Expected({"t": (torch.float32, (2,))})


class LentTensors(dict, LentReply):
    def __init__(self, spans: dict) -> None:
        super().__init__(spans)
        self.calls: list[str] = []

    def settle(self) -> concurrent.futures.Future[Any] | None:
        self.calls.append("settle")
        return None

    def release(self) -> None:
        self.calls.append("release")


class LentSide(ClientSide):
    """Carries replies whose header names it in ``path``; a request offers it in ``offers`` (it pins that
    request to one worker too)."""

    name: ClassVar[str] = "lent"

    def __init__(self) -> None:
        self.discarded: list[Reply] = []
        self.arrivals: list[Arrival] = []
        self.accepted: list[LentTensors] = []
        self.broken_for: list[str] = []

    def carries(self, reply: Reply) -> bool:
        return self.name in (reply.path or {})

    def accept(self, arrival: Arrival) -> LentTensors:
        self.arrivals.append(arrival)
        self.accepted.append(LentTensors(wire.parse(arrival.payload, max_bytes=arrival.max_bytes)[0]))
        return self.accepted[-1]

    def discard(self, reply: Reply) -> None:
        self.discarded.append(reply)

    def lent_bytes(self, reply: Reply) -> int:
        return int((reply.path or {})[self.name])

    def pins(self, request: SupervisionRequest) -> bool:
        return self.name in (request.offers or {})

    def without(self, request: SupervisionRequest) -> SupervisionRequest:
        return dataclasses.replace(request, offers=None)

    def broken(self, reason: str, reply: Reply | None = None) -> None:
        self.broken_for.append(reason)


class FollowSide(ClientSide):
    name: ClassVar[str] = "follow"
    tensors_follow: ClassVar[bool] = True

    def __init__(self) -> None:
        self.arrivals: list[Arrival] = []

    def carries(self, reply: Reply) -> bool:
        return self.name in (reply.path or {})

    def accept(self, arrival: Arrival) -> None:
        self.arrivals.append(arrival)
        return None


def path_of(side: ClientSide) -> type[ReplyPath]:
    class Path(ReplyPath):
        name = side.name

        @classmethod
        def worker(cls, setup):
            return None

        @classmethod
        def client(cls, setup: ClientSetup) -> ClientSide:
            return side

    return Path


class Harness:
    def __init__(self) -> None:
        self.stats = ClientStats()
        self.sent: list[bytes] = []
        self.sent_new: list[Pending] = []
        self.requests = Requests(self.send, self.stats, max_retries=2, leave_binding=self.leave_binding)
        self.replies = WorkerReplies(self.requests, self.stats, MAX_BYTES, call=lambda fn: fn(),
                                     send_new=self.sent_new.append)
        self.lent, self.follow = LentSide(), FollowSide()
        self.replies.paths = ClientPaths(ClientSetup(None, "svc", torch.device("cpu"), {}),  # type: ignore[arg-type]
                                         [path_of(self.lent), path_of(self.follow), FramesPath])

    def send(self, frames: list) -> None:
        self.sent.append(bytes(frames[3]))  # the request id frame of a control message

    def leave_binding(self, request_id: bytes, reason: str) -> None:
        self.replies.leave_pinned(request_id, reason)

    def add(self, command: ClientCommand = ClientCommand.REQUEST, **fields) -> Pending:
        header = (SupervisionRequest(reply_to="tcp://127.0.0.1:9", fingerprint=FINGERPRINT, **fields)
                  if command is ClientCommand.REQUEST else BindRequest(reply_to="tcp://127.0.0.1:9"))
        pending = Pending(new_request_id(), command.value, "svc", header, [], concurrent.futures.Future(), 30.0,
                          expect=EXPECT if command is ClientCommand.REQUEST else None)
        self.requests.add(pending, now=0.0)
        self.sent.clear()
        return pending

    def reply(self, pending: Pending | bytes, tensors: dict = TENSORS, **fields) -> None:
        request_id = pending if isinstance(pending, bytes) else pending.request_id
        header = Reply(worker="w1", fingerprint=FINGERPRINT, **fields)
        self.replies.on_data(data_message(Status.OK, request_id, header, wire.encode(tensors) if tensors else []))

    def error(self, pending: Pending | bytes, code: ErrorCode, error: str = "it went wrong") -> None:
        request_id = pending if isinstance(pending, bytes) else pending.request_id
        self.replies.on_data(data_message(Status.ERROR, request_id, ErrorReply(worker="w1", code=code.value,
                                                                               error=error)))


@pytest.fixture
def h():
    return Harness()


def test_a_frames_reply_resolves_its_request_with_the_bytes_where_they_arrived(h):
    pending = h.add()
    h.reply(pending)
    received = pending.future.result(0)
    assert received.request_id == pending.request_id and received.header.worker == "w1"
    landed = torch.empty(8, dtype=torch.uint8)
    received.tensors["t"].copy_into(landed)
    assert torch.equal(landed.view(torch.float32), TENSORS["t"])
    assert h.stats.replies == {"frames": 1} and h.stats.completed == 1 and len(h.requests.table) == 0


def test_batched_and_compact_replies_are_counted(h):
    for fields in ({"batched": 3}, {"kind": Kind.EAGLE3_COMPACT.value}, {"batched": 1}):
        h.reply(h.add(), **fields)
    assert (h.stats.batched, h.stats.compact_replies, h.stats.completed) == (1, 1, 3)


def test_a_second_reply_is_a_duplicate_and_what_it_lends_goes_back(h):
    pending = h.add()
    h.reply(pending, path={"lent": 0})
    assert h.stats.replies == {"lent": 1} and h.lent.discarded == []
    h.reply(pending, path={"lent": 0})
    h.reply(new_request_id(), path={"lent": 0})
    assert (h.stats.duplicates, h.stats.unknown, len(h.lent.discarded)) == (1, 1, 2)
    h.error(new_request_id(), ErrorCode.INTERNAL)
    assert h.stats.unknown == 2


def test_a_bad_request_error_fails_the_request_with_a_value_error(h):
    pending = h.add()
    h.error(pending, ErrorCode.BAD_REQUEST, "input_ids must be int64")
    with pytest.raises(ValueError, match=r"^worker w1: input_ids must be int64$"):
        pending.future.result(0)
    assert h.sent == []


def test_an_engine_death_fails_the_request_without_a_retry(h):
    pending = h.add()
    h.error(pending, ErrorCode.ENGINE_DEAD, "CUDA error: an illegal memory access")
    with pytest.raises(RemoteError, match=r"^worker w1: CUDA error: an illegal memory access \(its engine died "
                                          r"serving this request; the worker left the pool\)$"):
        pending.future.result(0)
    assert h.sent == [] and h.stats.retried == 0


@pytest.mark.parametrize("code", [ErrorCode.INTERNAL, ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT])
def test_other_errors_back_off_then_retry_until_attempts_run_out(h, code):
    pending = h.add()
    h.error(pending, code)
    assert pending.resend_at is not None and h.sent == [] and h.stats.retried == 1
    h.requests.check_timers(pending.resend_at + RETRY_BACKOFF_S)
    assert h.sent == [pending.request_id] and pending.attempts == 2
    h.error(pending, code)
    h.requests.check_timers(pending.resend_at + RETRY_BACKOFF_S)  # type: ignore[operator]
    h.error(pending, code)
    with pytest.raises(RemoteError, match="failed after 3 attempts: worker w1: it went wrong"):
        pending.future.result(0)


def test_a_reply_over_the_size_limit_fails_and_is_discarded_unread(h):
    pending = h.add()
    h.reply(pending, path={"lent": MAX_BYTES})  # its frames and the bytes it lends, together over the limit
    with pytest.raises(ValueError) as failed:
        pending.future.result(0)
    size = MAX_BYTES + sum(len(memoryview(f)) for f in wire.encode(TENSORS))
    assert str(failed.value) == (f"reply of {size} bytes from worker w1 exceeds this client's max_message_bytes "
                                 f"of {MAX_BYTES}")
    assert len(h.lent.discarded) == 1 and h.lent.arrivals == [] and h.sent == []


def test_a_reply_from_another_target_fails_and_is_discarded(h):
    pending = h.add()
    h.replies.on_data(data_message(Status.OK, pending.request_id,
                                   Reply(worker="w1", fingerprint="e" * 32, path={"lent": 0}), wire.encode(TENSORS)))
    with pytest.raises(TargetChangedError, match=f"serves target fingerprint {'e' * 32}, but this client set up "
                                                 f"with {FINGERPRINT}: its reply was discarded"):
        pending.future.result(0)
    assert h.stats.target_mismatches == 1 and len(h.lent.discarded) == 1 and h.lent.arrivals == []


def test_a_reply_breaking_the_contract_is_released_once_and_retried(h, caplog):
    pending = h.add()
    h.reply(pending, tensors={"t": torch.tensor([1.0, 2.0, 3.0])}, path={"lent": 0})
    [lent] = h.lent.accepted
    assert lent.calls == ["release"] and h.stats.contract_violations == 1
    assert not pending.future.done() and pending.resend_at is not None and h.stats.replies == {}
    assert "client.bad_reply" in caplog.text and "'t' is torch.float32[3], expected torch.float32[2]" in caplog.text


def test_a_path_asks_again_without_itself_under_a_new_id_at_no_cost(h):
    pending = h.add(offers={"lent": {}})
    h.reply(pending, path={"lent": 0})
    [arrival] = h.lent.arrivals
    assert arrival.expect == EXPECT.specs and arrival.max_bytes == MAX_BYTES
    future = arrival.again("the slot was torn")
    [again] = h.sent_new
    assert again.future is future and again.request_id != pending.request_id
    assert again.header == dataclasses.replace(pending.header, offers=None)
    assert (again.attempts, again.sent_at, again.resend_at) == (0, 0.0, None)
    assert h.stats.fallbacks == {"lent": 1}


def test_a_fallback_sends_the_request_again_without_the_path_once(h):
    pending = h.add(offers={"lent": {}})
    h.replies.fallback(pending.request_id, "lent", "no free slot")
    assert h.sent == [pending.request_id] and pending.attempts == 1 and pending.request.offers is None
    h.replies.fallback(pending.request_id, "lent", "no free slot")  # already without it
    h.replies.fallback(pending.request_id, "no-such-path", "x")
    h.replies.fallback(new_request_id(), "lent", "x")
    assert h.sent == [pending.request_id] and h.stats.fallbacks == {"lent": 1}


def test_a_pinned_request_that_fails_goes_back_to_the_pool(h):
    pending = h.add(offers={"lent": {}})
    h.replies.leave_pinned(pending.request_id, "no reply within 30s")
    assert h.lent.broken_for == ["no reply within 30s"]
    assert h.sent == [pending.request_id] and pending.attempts == 1 and pending.request.offers is None
    plain = h.add()  # not pinned: nothing to leave
    h.replies.leave_pinned(plain.request_id, "x")
    assert h.lent.broken_for == ["no reply within 30s"] and h.sent == []


def test_tensors_that_follow_resolve_later_and_a_stray_header_still_reaches_its_path(h):
    pending = h.add()
    h.reply(pending, tensors={}, path={"follow": {}})
    [arrival] = h.follow.arrivals
    assert arrival.expect == EXPECT.specs and not pending.future.done()
    h.replies.resolve_followed(pending.request_id, Reply(worker="w1", fingerprint=FINGERPRINT), TENSORS, "follow")
    assert pending.future.result(0).tensors is TENSORS and h.stats.replies == {"follow": 1}
    h.reply(new_request_id(), tensors={}, path={"follow": {}})  # nobody waits: the path still drains its channel
    stray = h.follow.arrivals[1]
    assert stray.expect is None
    with pytest.raises(RuntimeError, match="cannot be asked for again here: torn"):
        stray.again("torn")
    h.replies.resolve_followed(stray.request_id, Reply(worker="w1"), TENSORS, "follow")
    assert h.stats.unknown == 1  # counted once, when its tensors came


def test_an_accepted_bind_resolves_with_its_grant(h):
    bind = h.add(ClientCommand.BIND)
    h.replies.on_data(data_message(Status.OK, bind.request_id, BindGrant(worker="w1")))
    received = bind.future.result(0)
    assert isinstance(received.header, BindGrant) and received.header.worker == "w1" and received.tensors == {}
