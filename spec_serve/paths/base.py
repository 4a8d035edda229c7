"""``ReplyPath``: one way a reply's bytes travel from a worker to the client that asked, both halves in one
place (the worker's ``WorkerSide`` and the client's ``ClientSide``), chosen per reply from the table in
``registry.py``.

Worker side, on the compute thread: ``takes`` (may this path carry a request's reply?), ``local`` (does
the reply then stay on this host? ``compact="auto"`` sends those full), ``deliver`` (put the outputs where
the reply carries them: an ``Outgoing`` for the I/O thread, or None to pass the reply to the next path).
Client side, on the I/O thread: ``offer`` (what a request carries so a worker may use the path: an
``Offer``, sent under the request's ``offers[name]``; the reply's ``path[name]`` is the path's descriptor),
``carries`` and ``accept`` (a data message to the reply's tensors), and ``settle``/``release`` (through
``LentReply``: what a reply borrows goes back once its bytes were copied, or were not used).

Every byte a path lends has an owner and a release: on the worker, ``Outgoing.loan`` (``Loan.left``
once ZeroMQ let go of every frame, ``Loan.dropped`` when the reply is never sent) and ``close`` for
everything the path holds (segments, CUDA IPC handles, pair groups); on the client, ``LentReply`` per reply
and ``close``/``stop`` for the path.
"""

from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from spec_serve.protocol.commands import ClientCommand, Message, Status, WorkerCommand
from spec_serve.protocol.messages import (
    BindGrant,
    ErrorReply,
    Reply,
    SupervisionRequest,
    WireMessage,
)
from spec_serve.supervision.contract import ReplySpecs

if TYPE_CHECKING:
    from spec_serve.paths.faults import Faults
    from spec_serve.paths.frames.hostpool import HostBufferPool
    from spec_serve.transport.sockets import Security


class PathUnavailable(Exception):
    """A request asks for this path by name and it cannot carry the reply now (the worker answers
    ``unavailable``; the client asks again another way)."""


# ------------------------------------------------------------------------ worker side


class Loan(Protocol):
    """Memory a sent reply borrows until ZeroMQ let go of its frames (a pooled slab, a lent slot)."""

    def left(self) -> None:
        """Every frame of the sent reply has left ZeroMQ."""

    def dropped(self) -> None:
        """The reply will never be sent: what it borrows goes back now."""


@dataclasses.dataclass
class Outgoing:
    """A reply as a path hands it to the worker's I/O thread: the data message's header and payload
    frames, the event after which they may be sent, what they borrow, and (NCCL) what the compute thread
    sends once the header is posted."""

    reply: Reply | BindGrant | ErrorReply  # a path's is a Reply; an error's or a control job's, the others
    frames: list[Any]
    via: str  # DONE's ``via``: frames, shm, cuda, nccl, ...
    ready: torch.cuda.Event | None = None
    loan: Loan | None = None
    after_post: Callable[[], None] | None = None
    lent_bytes: int = 0  # bytes the reply lends outside its frames (counted against max_reply_bytes)


@dataclasses.dataclass
class Delivery:
    """One reply to deliver: the request it answers, the engine's outputs and the header so far."""

    request_id: bytes
    request: SupervisionRequest
    tensors: dict[str, torch.Tensor]
    reply: Reply


Post = Callable[[Status, "BindGrant | ErrorReply"], None]  # answer a control job at its reply_to
SubmitControl = Callable[[str, bytes, dict[str, Any]], None]  # (control, request id, header) to the compute thread


class WorkerSide:
    """A worker's half of a path. ``takes``, ``local``, ``deliver`` and ``control`` run on the compute
    thread; ``handlers`` and ``before_ready`` on the I/O thread; ``start`` and ``close`` from ``Worker.run``."""

    name: ClassVar[str]
    # Compute-thread control jobs this path runs in order with the requests (NCCL: bind, release), and
    # the message each carries.
    control_messages: ClassVar[Mapping[str, type[WireMessage]]] = {}
    # True: some reply bytes travel outside the data messages, counted by ``sent_apart`` (NCCL's tensors).
    sends_apart: ClassVar[bool] = False
    # False: a reply this path carries is computed alone, never in a packed forward with others (a path that
    # sends each reply's tensors as the engine left them, on a channel of its own).
    packs: ClassVar[bool] = True
    # Whether this path carries float8 hidden states (a request's wire_dtype="fp8"); False: the worker sends
    # them in the model dtype and the client counts that (ClientStats.fp8_declined).
    sends_fp8: ClassVar[bool] = True

    def takes(self, request: SupervisionRequest) -> bool:
        """Whether this path may carry the reply to ``request``; ``PathUnavailable`` if the request
        insists on it and it cannot."""
        raise NotImplementedError

    def local(self, request: SupervisionRequest) -> bool:
        """Whether the reply, carried by this path, stays on this host (``compact="auto"``: sent full)."""
        return False

    def deliver(self, items: Sequence[Delivery]) -> list[Outgoing | None]:
        """Each reply ready to hand to the I/O thread, or None where this path cannot carry it after all
        (the next path that takes it does)."""
        raise NotImplementedError

    def handlers(self, submit: SubmitControl) -> dict[WorkerCommand, Callable[[Message], None]]:
        """Broker commands this path answers (I/O thread); ``submit`` queues a control job."""
        return {}

    def control(self, control: str, message: WireMessage, post: Post) -> None:
        """Run a control job of ``control_messages`` (compute thread)."""
        raise NotImplementedError(control)

    def before_ready(self, submit: SubmitControl) -> None:
        """Before the worker registers (again): forget what the broker forgets with a new registration."""

    def begin_drain(self) -> None:
        """The worker is draining (it left the pool): take on nothing new (NCCL: no new binding)."""

    def start(self) -> None:
        """The worker starts serving: take what the path needs (shared memory, ...)."""

    def lent_out(self) -> int:
        """Replies whose memory a client still holds (a stopping worker waits for them before ``close``)."""
        return 0

    def sent_apart(self) -> int:
        """Reply bytes sent apart from the data messages, which DONE does not count (NCCL: the pair group)."""
        return 0

    def close(self) -> None:
        """Give back everything the path holds (idempotent; after the compute thread stopped)."""

    def before_hard_exit(self) -> None:
        """The process ends with ``os._exit`` (a forward still runs: drain.exit_if_computing), after ``close``:
        remove what the interpreter's normal exit would have (the plane: CUDA IPC files in /dev/shm)."""


# ------------------------------------------------------------------------ client side


class LentReply(abc.ABC):
    """A reply's tensors that borrow a peer's memory (a plane slot): ``settle`` once they were copied out,
    ``release`` if they will not be used; either gives the memory back, once."""

    @abc.abstractmethod
    def settle(self) -> concurrent.futures.Future[Any] | None:
        """None if the copies hold the bytes the peer lent; else the future of the request asked again."""

    @abc.abstractmethod
    def release(self) -> None:
        """Give the memory back without looking."""


def settle(tensors: object) -> concurrent.futures.Future[Any] | None:
    """``LentReply.settle`` for a reply that borrows memory; None for any other."""
    return tensors.settle() if isinstance(tensors, LentReply) else None


def release(tensors: object) -> None:
    """``LentReply.release`` for a reply that borrows memory; nothing for any other."""
    if isinstance(tensors, LentReply):
        tensors.release()


@dataclasses.dataclass
class Arrival:
    """A worker's data message for a path's client side. ``expect``: the tensors the request expects of
    this reply (None: nothing waits for it); ``again(reason)``: the request sent once more without this
    path under a new id (any thread; the future of its answer)."""

    request_id: bytes
    reply: Reply
    header: dict[str, Any]
    payload: list[Any]
    expect: ReplySpecs | None
    max_bytes: int
    again: Callable[[str], concurrent.futures.Future[Any]]


class ClientPort(Protocol):
    """What a path's client side uses of the client's I/O thread."""

    data_endpoint: str
    data_key: str | None
    local_host: str

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the I/O thread."""

    def send_control(self, frames: list[Any]) -> None:
        """I/O thread: a control message to the broker."""

    def submit(self, command: ClientCommand, service: str, header: WireMessage, payload: Sequence[Any],
               timeout: float, max_retries: int | None = None) -> concurrent.futures.Future[Any]:
        """A request to the broker; the future of its ``Received`` answer."""

    def resolve(self, request_id: bytes, reply: Reply, tensors: dict[str, torch.Tensor], path: str) -> None:
        """I/O thread: tensors that followed a reply's header (``ClientSide.tensors_follow``) arrived."""

    def fallback(self, request_id: bytes, path: str, reason: str) -> None:
        """I/O thread: ask for the request again without ``path`` (no attempt used)."""


@dataclasses.dataclass(frozen=True)
class Offer:
    """What a request carries for one path: ``body``, sent as the request's ``offers[name]`` (JSON, typed and
    checked by the path; None: nothing), ``pin``, the one worker that may take the request (one this client
    holds: the broker sends the request there, never to the pool), and ``near``, the host whose workers the
    broker prefers for it."""

    body: Any = None
    pin: str | None = None
    near: str | None = None  # a host key: the broker prefers a worker of that host (the path pays only there)


class ClientSide:
    """A client's half of a path. ``offer`` runs on user threads; the rest on the I/O thread unless noted."""

    name: ClassVar[str]
    # True when the tensors follow the header on another channel: ``accept`` then resolves the request
    # itself (``ClientPort.resolve``) or falls back, and is called even for a reply nobody waits for.
    tensors_follow: ClassVar[bool] = False

    def offer(self, op: str) -> Offer | None:
        """What a request of ``op`` carries so a worker may use this path; None: not now."""
        return None

    def carries(self, reply: Reply) -> bool:
        """Whether this data message came this way: it names this path's descriptor."""
        return reply.descriptor(self.name) is not None

    def accept(self, arrival: Arrival) -> Mapping[str, Any] | None:
        """The reply's tensors (spans or tensors; a ``LentReply`` if they borrow memory), or None when there
        is nothing to resolve now (it fell back, or the tensors follow)."""
        raise NotImplementedError

    def discard(self, reply: Reply) -> None:
        """A reply nobody will read (answered already, another target): give back what it lends."""

    def lent_bytes(self, reply: Reply) -> int:
        """Bytes the reply claims outside its frames, for the client's size limit."""
        return 0

    def pins(self, request: SupervisionRequest) -> bool:
        """Whether ``request`` may go to one worker only because of this path (it holds a worker: ``pin``)."""
        return False

    @property
    def may_hold(self) -> bool:
        """Whether this path holds a worker for this client when it can (``holds``, ``hold_again``)."""
        return False

    def holds(self) -> str | None:
        """The worker this path holds for this client (the ``pin`` of its offers), or None."""
        return None

    def hold_again(self) -> str | None:
        """Let go of the worker held (if any) and take one now; its name, or None (``may_hold`` paths)."""
        raise NotImplementedError

    def without(self, request: SupervisionRequest) -> SupervisionRequest:
        """``request`` as it is asked again when this path failed it: without this path's offer."""
        return request.without_offer(self.name)

    def elsewhere(self, request: SupervisionRequest, reason: str) -> SupervisionRequest:
        """``request`` as it goes to another worker (a digest mismatch): a path that pins it to one worker
        lets go of it."""
        return request

    def broken(self, reason: str, reply: Reply | None = None) -> None:
        """Stop using this path for now (what failed: ``reason``)."""

    def on_broker(self, header: WireMessage) -> None:
        """A message from the broker (I/O thread)."""

    def tick(self) -> None:
        """Once a heartbeat interval (I/O thread)."""

    def close(self) -> None:
        """The client closes (user thread, before it leaves the broker): give back what peers hold for it."""

    def stop(self) -> None:
        """The I/O thread stops: drop what the path holds locally."""


# ------------------------------------------------------------------------ the path


@dataclasses.dataclass
class WorkerSetup:
    """What a worker's paths are built from (each takes what it needs)."""

    name: str
    device: torch.device
    broker_url: str
    advertise_host: str | None
    security: Security | None
    faults: Faults
    host_pool: HostBufferPool | None
    copy_stream: torch.cuda.Stream | None
    plane_slots: int
    plane_lease: float | None  # None: the plane's default
    insecure_network: bool = False  # its listeners (the NCCL rendezvous) may bind beyond loopback unauthenticated


@dataclasses.dataclass
class ClientSetup:
    """What a client's paths are built from (each takes what it needs)."""

    port: ClientPort
    service: str
    device: torch.device
    options: Mapping[str, Any]  # RemoteTargetModel's path options: same_host_plane, enable_nccl, nccl_timeout, ...


class ReplyPath(abc.ABC):
    """One way replies travel: its name and how each side builds its half (None: off there)."""

    name: ClassVar[str]

    @classmethod
    @abc.abstractmethod
    def worker(cls, setup: WorkerSetup) -> WorkerSide | None: ...

    @classmethod
    @abc.abstractmethod
    def client(cls, setup: ClientSetup) -> ClientSide | None: ...
