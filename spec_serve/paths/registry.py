"""The reply paths and the one order every reply tries them in; a worker's and a client's set of them.

Adding a path: its folder (a ``ReplyPath`` and its two halves, base.py), one line in ``PATHS``, its tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from spec_serve.paths.base import (
    ClientSetup,
    ClientSide,
    Delivery,
    Outgoing,
    PathUnavailable,
    Post,
    ReplyPath,
    SubmitControl,
    WorkerSetup,
    WorkerSide,
)
from spec_serve.paths.frames import FramesPath
from spec_serve.paths.nccl import NcclPath
from spec_serve.paths.plane import PlanePath
from spec_serve.protocol.commands import Message, ReplyFormat, WorkerCommand
from spec_serve.protocol.messages import Reply, SupervisionRequest, WireMessage
from spec_serve.supervision.contract import Kind

# Every reply path, in the order each reply tries them: the first that takes a reply carries it, and one
# that cannot deliver it after all hands it on to the next that takes it. Frames take every reply: last.
PATHS: tuple[type[ReplyPath], ...] = (NcclPath, PlanePath, FramesPath)


@dataclasses.dataclass(frozen=True)
class Route:
    """The path chosen for one reply, and the supervision kind the engine computes for it (GENERATE)."""

    side: WorkerSide
    kind: str | None = None
    chosen: bool = False  # the worker chose the format (``format: auto``): the reply names its kind

    @property
    def reply_kind(self) -> str | None:
        """The reply header's ``kind``: set when the worker chose it."""
        return self.kind if self.chosen else None


def reply_kind(request: SupervisionRequest, side: WorkerSide) -> tuple[str | None, bool]:
    """The kind a GENERATE reply is computed as, and whether the worker chose it: the rule of
    ``compact="auto"``, in one place. An EAGLE-3 request with ``format: auto`` is answered full when its path
    keeps the reply on this host (``WorkerSide.local``: the same-host plane, NCCL to a client of this host)
    and compact otherwise (frames, even on one host: the compact reply is a fifth of the bytes; NCCL across
    hosts); the client expands a compact one on its device. Decided before the forward, from the path the
    reply takes: if that path cannot deliver it after all (no free plane slot), the next path carries it as
    computed (full over frames), and a request asked again without a path is routed, so decided, afresh."""
    if not request.is_generate:
        return None, False
    kind = request.supervision_kind
    if request.format != ReplyFormat.AUTO.value or kind != Kind.EAGLE3.value:
        return kind, False
    return (Kind.EAGLE3.value if side.local(request) else Kind.EAGLE3_COMPACT.value), True


class WorkerPaths:
    """A worker's halves of ``paths`` (those not off on it), in their order."""

    def __init__(self, setup: WorkerSetup, paths: Sequence[type[ReplyPath]] | None = None):
        self.sides = [side for side in (path.worker(setup) for path in paths or PATHS) if side is not None]
        self.control_messages: dict[str, type[WireMessage]] = {}
        self._control_sides: dict[str, WorkerSide] = {}
        for side in self.sides:
            for control, message in side.control_messages.items():
                self.control_messages[control] = message
                self._control_sides[control] = side

    def named(self, name: str) -> WorkerSide | None:
        return next((side for side in self.sides if side.name == name), None)

    def route(self, request: SupervisionRequest) -> Route:
        """The first path that takes ``request``'s reply (``PathUnavailable`` if one it insists on cannot)."""
        for side in self.sides:
            if side.takes(request):
                return Route(side, *reply_kind(request, side))
        raise RuntimeError(f"no reply path takes this request (paths: {[s.name for s in self.sides]})")

    def deliver(self, routes: Sequence[Route], items: Sequence[Delivery]) -> list[Outgoing]:
        """Each reply through its route's path, or the next path after it that takes it. On an exception,
        what was delivered so far is dropped."""
        out: list[Outgoing | None] = [None] * len(items)
        first = [self.sides.index(route.side) for route in routes]
        try:
            for position, side in enumerate(self.sides):
                mine = [i for i in range(len(items))
                        if out[i] is None and (first[i] == position or
                                               (first[i] < position and self._takes(side, items[i].request)))]
                if mine:
                    for i, outgoing in zip(mine, side.deliver([items[i] for i in mine])):
                        out[i] = outgoing
            missing = [i for i, o in enumerate(out) if o is None]
            if missing:
                raise RuntimeError(f"no reply path delivered {len(missing)} of {len(items)} replies")
        except BaseException:
            for outgoing in out:
                if outgoing is not None and outgoing.loan is not None:
                    outgoing.loan.dropped()
            raise
        return [o for o in out if o is not None]

    @staticmethod
    def _takes(side: WorkerSide, request: SupervisionRequest) -> bool:
        try:
            return side.takes(request)
        except PathUnavailable:
            return False

    def control(self, control: str, message: WireMessage, post: Post) -> None:
        self._control_sides[control].control(control, message, post)

    def handlers(self, submit: SubmitControl) -> dict[WorkerCommand, Callable[[Message], None]]:
        merged: dict[WorkerCommand, Callable[[Message], None]] = {}
        for side in self.sides:
            merged.update(side.handlers(submit))
        return merged

    def before_ready(self, submit: SubmitControl) -> None:
        for side in self.sides:
            side.before_ready(submit)

    def begin_drain(self) -> None:
        for side in self.sides:
            side.begin_drain()

    def start(self) -> None:
        for side in self.sides:
            side.start()

    def sent_apart(self) -> dict[str, int]:
        """Reply bytes each path that ``sends_apart`` sent apart from the data messages, by path: zero too, so
        /metrics has the series before the first byte (a rate or an alert on it works from the start)."""
        return {side.name: side.sent_apart() for side in self.sides if side.sends_apart}

    def lent_out(self) -> int:
        """Replies whose memory clients still hold, over every path (the plane's slots lent out)."""
        return sum(side.lent_out() for side in self.sides)

    def close(self) -> None:
        """Give back everything every path holds: the NCCL pair group closed, same-host plane segments and
        CUDA IPC handles unlinked (idempotent; after the compute thread stopped)."""
        for side in self.sides:
            side.close()


class ClientPaths:
    """A client's halves of ``paths`` (those not off on it), in their order."""

    def __init__(self, setup: ClientSetup, paths: Sequence[type[ReplyPath]] | None = None):
        self.sides = [side for side in (path.client(setup) for path in paths or PATHS) if side is not None]

    def named(self, name: str) -> ClientSide | None:
        return next((side for side in self.sides if side.name == name), None)

    def offer(self, op: str) -> dict[str, Any]:
        """What a request of ``op`` carries: the first path's offer (none: frames)."""
        for side in self.sides:
            fields = side.offer(op)
            if fields is not None:
                return fields
        return {}

    def carrying(self, reply: Reply) -> ClientSide:
        """The path a worker's data message came by."""
        for side in self.sides:
            if side.carries(reply):
                return side
        raise RuntimeError(f"no reply path carries this reply (paths: {[s.name for s in self.sides]})")

    def elsewhere(self, request: SupervisionRequest, reason: str) -> SupervisionRequest:
        """``request`` as it goes to another worker: paths that pin it to one worker let go of it."""
        for side in self.sides:
            request = side.elsewhere(request, reason)
        return request

    def on_broker(self, header: WireMessage) -> None:
        for side in self.sides:
            side.on_broker(header)

    def tick(self) -> None:
        for side in self.sides:
            side.tick()

    def close(self) -> None:
        for side in self.sides:
            side.close()

    def stop(self) -> None:
        for side in self.sides:
            side.stop()
