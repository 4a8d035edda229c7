"""What the worker's two threads hand each other: a ``Job`` (a broker request, or a reply path's control job
such as a binding's bind or release) from the I/O thread to the compute thread, and a ``Result`` (a reply
ready to send) back."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from spec_serve.paths.base import Loan, Outgoing
from spec_serve.paths.registry import Route
from spec_serve.protocol.commands import ErrorCode, ProtocolError, Status
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
    job: Job
    status: Status
    reply: Reply | BindGrant | ErrorReply  # the data message's header
    frames: list
    tokens: int = 0
    ready: torch.cuda.Event | None = None  # the frames' device->host copy; sent only once it completed
    loan: Loan | None = None  # memory the reply borrows (a host slab, a lent slot): ``left`` once sent
    via: str = "frames"  # the reply path, for DONE
    lent_bytes: int = 0  # bytes lent outside the frames (a lent slot)
    after_post: Callable[[], None] | None = None  # compute thread, once posted (tensors that follow)

    @classmethod
    def delivered(cls, job: Job, outgoing: Outgoing, tokens: int) -> Result:
        """The result of ``job`` as a reply path handed it over."""
        return cls(job, Status.OK, outgoing.reply, outgoing.frames, tokens, outgoing.ready, outgoing.loan,
                   outgoing.via, outgoing.lent_bytes, outgoing.after_post)

    @property
    def header(self) -> dict[str, Any]:
        """The data message's header as sent."""
        return self.reply.to_json()

    @property
    def nbytes(self) -> int:
        """The reply's payload: its frames, plus the bytes it lends outside them (a lent slot)."""
        return sum(len(memoryview(f)) for f in self.frames) + self.lent_bytes

    def drop(self) -> None:
        """The reply will not be sent: what it borrowed goes back now."""
        if self.loan is not None:
            self.loan.dropped()


def done_status(result: Result) -> str:
    """The DONE status of a reply handed to ZeroMQ; ``engine_dead`` tells the broker to send no more."""
    if result.status is Status.OK:
        return "ok"
    dead = isinstance(result.reply, ErrorReply) and result.reply.code == ErrorCode.ENGINE_DEAD.value
    return "engine_dead" if dead else "error"


def error_result(job: Job, worker: str, code: ErrorCode, message: str) -> Result:
    """An error reply to ``job``: no payload, the code and message the client reads."""
    return Result(job, Status.ERROR, ErrorReply(worker=worker, code=code.value, error=message), [])
