"""The reply paths and the one order every reply tries them in; a worker's and a client's set of them.

Adding a path: its folder (a ``ReplyPath`` and its two halves, base.py, with its offer and descriptor), one
line in ``PATHS``, its tests. Nothing in protocol/ or broker/ names a path: a request carries each path's
offer opaquely (``offers[name]``), a reply its descriptor (``path[name]``), and a path that holds a worker for
its client routes by the generic ``pin``.
"""

from __future__ import annotations

import dataclasses
import importlib
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
from spec_serve.protocol.commands import Message, ReplyFormat, WorkerCommand
from spec_serve.protocol.messages import Reply, SupervisionRequest, WireMessage
from spec_serve.supervision.contract import Kind

# Every reply path, in the order each reply tries them: the first that takes a reply carries it, and one
# that cannot deliver it after all hands it on to the next that takes it. Frames take every reply: last.
# Each is "module:class", imported when a worker's or client's paths are first built: importing the client
# or the worker loads no path (NCCL's torch.distributed only where paths are built).
PATHS: tuple[str, ...] = (
    "spec_serve.paths.nccl:NcclPath",
    "spec_serve.paths.plane:PlanePath",
    "spec_serve.paths.frames:FramesPath",
)


def load(entry: str | type[ReplyPath]) -> type[ReplyPath]:
    """The ``ReplyPath`` that a ``PATHS`` entry names ("module:class"; a class is taken as it is)."""
    if not isinstance(entry, str):
        return entry
    module, _, name = entry.partition(":")
    path = getattr(importlib.import_module(module), name)
    if not (isinstance(path, type) and issubclass(path, ReplyPath)):
        raise TypeError(f"reply path {entry!r} is not a ReplyPath")
    return path


def _loaded(paths: Sequence[str | type[ReplyPath]] | None) -> list[type[ReplyPath]]:
    return [load(entry) for entry in (PATHS if paths is None else paths)]


@dataclasses.dataclass(frozen=True)
class Offers:
    """What a request carries for its reply paths: the first path's offer (under ``offers[name]``), the
    worker it pins the request to and the host it prefers, if any."""

    offers: dict[str, Any] | None = None
    pin: str | None = None
    near: str | None = None

    def __bool__(self) -> bool:
        return self.offers is not None or self.pin is not None


@dataclasses.dataclass(frozen=True)
class Route:
    """The path chosen for one reply, and the supervision kind the engine computes for it (GENERATE)."""

    side: WorkerSide
    kind: str | None = None
    chosen: bool = False  # the worker chose the format (``format: auto``): the reply names its kind

    @property
    def packs(self) -> bool:
        """Whether the reply may share a packed forward with others (its path takes packed outputs)."""
        return self.side.packs

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

    def __init__(self, setup: WorkerSetup, paths: Sequence[str | type[ReplyPath]] | None = None):
        self.sides = [side for side in (path.worker(setup) for path in _loaded(paths)) if side is not None]
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

    def before_hard_exit(self) -> None:
        for side in self.sides:
            side.before_hard_exit()


class ClientPaths:
    """A client's halves of ``paths`` (those not off on it), in their order."""

    def __init__(self, setup: ClientSetup, paths: Sequence[str | type[ReplyPath]] | None = None):
        self.sides = [side for side in (path.client(setup) for path in _loaded(paths)) if side is not None]

    def named(self, name: str) -> ClientSide | None:
        return next((side for side in self.sides if side.name == name), None)

    def offer(self, op: str) -> Offers:
        """What a request of ``op`` carries: the first path's offer (none: frames)."""
        for side in self.sides:
            offer = side.offer(op)
            if offer is not None:
                return Offers({side.name: offer.body} if offer.body is not None else None, offer.pin, offer.near)
        return Offers()

    def holds(self) -> str | None:
        """The worker a path holds for this client (requests pinned to it), or None."""
        return next((worker for worker in (side.holds() for side in self.sides) if worker is not None), None)

    def hold_again(self, before: Callable[[], object]) -> str | None:
        """Let go of the worker held and take one now, after ``before()`` (the first path that holds workers);
        its name or None. ``NotImplementedError``: no path here holds workers."""
        side = next((side for side in self.sides if side.may_hold), None)
        if side is None:
            raise NotImplementedError("no reply path of this client holds a worker")
        before()
        return side.hold_again()

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
