"""What the worker's two threads hand each other: a ``Job`` (a broker request, or a bind/release of the
NCCL pair) from the I/O thread to the compute thread, and a ``Result`` (an encoded reply) back."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from spec_serve.protocol.commands import ErrorCode, Status
from spec_serve.transport import samehost
from spec_serve.transport.hostpool import Lease


class RequestError(Exception):
    """A request the engine refused; ``code`` tells the client whether to retry."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code


@dataclasses.dataclass
class Job:
    request_id: bytes
    header: dict[str, Any]
    payload: list
    received_at: float
    tensors: dict | None = None  # decoded request, cached when the batcher looked at it
    control: str | None = None  # "bind" / "release": NCCL pairing, run in order with jobs on the compute thread


@dataclasses.dataclass
class Result:
    job: Job
    status: Status
    header: dict[str, Any]
    frames: list
    tokens: int = 0
    lease: Lease | None = None  # pooled host buffer the frames borrow; released once sent
    ready: torch.cuda.Event | None = None  # the frames' device->host copy; sent only once it completed
    send: dict | None = None  # tensors for the pair group, sent by the compute thread once this header is posted
    export: samehost.Export | None = None  # a slot lent through the same-host plane; cancelled if undeliverable

    @property
    def nbytes(self) -> int:
        """The reply's payload: its frames, plus the bytes it lends through the same-host plane."""
        return sum(len(memoryview(f)) for f in self.frames) + (self.export.nbytes if self.export else 0)

    def drop(self) -> None:
        """The reply will not be sent: what it borrowed goes back now."""
        if self.lease is not None:
            self.lease.release()
        if self.export is not None:
            self.export.cancel()


def done_status(result: Result) -> str:
    """The DONE status of a reply handed to ZeroMQ; ``engine_dead`` tells the broker to send no more."""
    if result.status is Status.OK:
        return "ok"
    return "engine_dead" if result.header.get("code") == ErrorCode.ENGINE_DEAD.value else "error"


def error_result(job: Job, worker: str, code: ErrorCode, message: str) -> Result:
    """An error reply to ``job``: no payload, the code and message the client reads."""
    return Result(job, Status.ERROR, {"worker": worker, "code": code.value, "error": message}, [])
