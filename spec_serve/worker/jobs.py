"""What the worker's two threads hand each other: a ``Job`` (a broker request, or a reply path's control job
such as a binding's bind or release) from the I/O thread to the compute thread, and a ``Result`` (a reply
ready to send) back."""

from __future__ import annotations

import dataclasses
from typing import Any

from spec_serve.paths.base import Outgoing
from spec_serve.paths.registry import Route
from spec_serve.protocol.commands import DoneStatus, ErrorCode, ProtocolError, Status
from spec_serve.protocol.messages import BindGrant, ErrorReply, Reply, SupervisionRequest, WireMessage


class RequestError(Exception):
    """A request the engine refused; ``code`` tells the client whether to retry."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code


@dataclasses.dataclass
class Job:
    request_id: bytes
    header: dict[str, Any]  # as the broker sent it; read through ``message`` (checked once, at construction)
    payload: list
    received_at: float
    tensors: dict | None = None  # decoded request, cached when the batcher looked at it
    control: str | None = None  # a reply path's control job (its ``control_messages``), run in order with jobs
    # A control job's message comes parsed (WorkerPaths.control_messages); a request's is parsed here.
    message: WireMessage | None = None
    refused: str | None = dataclasses.field(init=False, default=None)  # why its header is invalid: bad_request
    route: Route | None = dataclasses.field(init=False, default=None)  # its reply's path and kind, once chosen

    def __post_init__(self) -> None:
        """A request whose header does not check out is still answered (bad_request) at its ``reply_to``,
        as a request the engine refuses is; a request with nowhere to reply raises."""
        if self.control is not None:
            assert self.message is not None, "a control job comes with its message"
            return
        try:
            self.message = SupervisionRequest.from_json(self.header)
        except ProtocolError as e:
            reply_to = self.header.get("reply_to")
            if not isinstance(reply_to, str):
                raise
            key = self.header.get("data_key")
            self.message = SupervisionRequest(reply_to=reply_to, data_key=key if isinstance(key, str) else None)
            self.refused = str(e)

    @property
    def reply_route(self) -> tuple[str, str | None]:
        """Where its answer goes: the client's data endpoint and that socket's CURVE key (a request's, or a
        control message's that answers, such as a bind)."""
        reply_to, data_key = getattr(self.message, "reply_to", None), getattr(self.message, "data_key", None)
        assert isinstance(reply_to, str), self.control
        return reply_to, data_key

    @property
    def request(self) -> SupervisionRequest:
        assert isinstance(self.message, SupervisionRequest), self.control
        return self.message


@dataclasses.dataclass
class Result:
    """A job's answer for the I/O thread: its status, the data message as a reply path (or an error, or a
    control job) handed it over (``out``: header, frames, the device->host copy they wait for, what they
    borrow, what follows them), and the tokens it served."""

    job: Job
    status: Status
    out: Outgoing
    tokens: int = 0

    @classmethod
    def answer(cls, job: Job, status: Status, header: Reply | BindGrant | ErrorReply) -> Result:
        """A reply without payload (an error, a control job's answer), as frames."""
        return cls(job, status, Outgoing(header, [], "frames"))

    @property
    def reply(self) -> Reply | BindGrant | ErrorReply:
        """The data message's header."""
        return self.out.reply

    @property
    def frames(self) -> list:
        return self.out.frames

    @property
    def header(self) -> dict[str, Any]:
        """The data message's header as sent."""
        return self.reply.to_json()

    @property
    def nbytes(self) -> int:
        """The reply's payload: its frames, plus the bytes it lends outside them (a lent slot)."""
        return sum(len(memoryview(f)) for f in self.frames) + self.out.lent_bytes

    def drop(self) -> None:
        """The reply will not be sent: what it borrowed goes back now."""
        if self.out.loan is not None:
            self.out.loan.dropped()


def done_status(result: Result) -> DoneStatus:
    """The DONE status of a reply handed to ZeroMQ; ``engine_dead`` tells the broker to send no more."""
    if result.status is Status.OK:
        return DoneStatus.OK
    dead = isinstance(result.reply, ErrorReply) and result.reply.code == ErrorCode.ENGINE_DEAD.value
    return DoneStatus.ENGINE_DEAD if dead else DoneStatus.ERROR


def error_result(job: Job, worker: str, code: ErrorCode, message: str) -> Result:
    """An error reply to ``job``: no payload, the code and message the client reads."""
    return Result.answer(job, Status.ERROR, ErrorReply(worker=worker, code=code.value, error=message))
