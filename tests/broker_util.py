"""Helpers for the broker's socket-free tests: a recording ``send`` and the messages peers would send.

The broker's parts never touch a socket; they speak through ``send(peer, identity, frames)``. A
``Recorder`` keeps every message they would have put on the wire, parsed, so a test asserts on those.
"""

from __future__ import annotations

from spec_serve.broker.context import Peer
from spec_serve.broker.routing import Router
from spec_serve.broker.server import CLIENT_HEADERS, WORKER_HEADERS, typed_header
from spec_serve.protocol.commands import (
    CLIENT_TAG,
    WORKER_TAG,
    ClientCommand,
    Message,
    WorkerCommand,
    control,
    new_request_id,
    parse_control,
)

SERVICE = "svc"
TARGET_INFO = {"num_hidden_layers": 2, "hidden_size": 8, "vocab_size": 32, "aux_layer_ids": [0, 1],
               "dspark_layer_ids": [1], "model_name": "tiny", "dtype": "float32", "engine": "fake",
               "fingerprint": "f" * 32}


class Recorder:
    """A ``send`` that keeps every message, parsed, and reports every peer reachable (except ``unreachable``)."""

    def __init__(self):
        self.sent: list[tuple[Peer, bytes, Message]] = []
        self.unreachable: set[bytes] = set()

    def __call__(self, peer: Peer, identity: bytes, frames: list) -> bool:
        if identity in self.unreachable:
            return False
        tag, commands = (CLIENT_TAG, ClientCommand) if peer is Peer.CLIENT else (WORKER_TAG, WorkerCommand)
        self.sent.append((peer, identity, parse_control(frames, tag, commands)))
        return True

    def take(self) -> list[tuple[Peer, bytes, Message]]:
        sent, self.sent = self.sent, []
        return sent

    def requests_to(self, worker: bytes) -> list[bytes]:
        """Request ids sent to ``worker`` as REQUEST, in order, since the last ``take``."""
        return self.commands_to(worker, WorkerCommand.REQUEST)

    def commands_to(self, worker: bytes, command: WorkerCommand) -> list[bytes]:
        """Request ids of the ``command`` messages sent to ``worker`` since the last ``take``."""
        return [m.request_id for peer, who, m in self.sent
                if peer is Peer.WORKER and who == worker and m.command == command.value]

    def to_client(self, client: bytes, command: ClientCommand = ClientCommand.ERROR) -> list[Message]:
        """The ``command`` messages sent to ``client`` since the last ``take``."""
        return [m for peer, who, m in self.sent if peer is Peer.CLIENT and who == client and m.command == command.value]


def message(tag: bytes, command, request_id: bytes = b"", header: dict | None = None, service: str = SERVICE,
            payload: list | None = None) -> Message:
    commands = ClientCommand if tag == CLIENT_TAG else WorkerCommand
    return parse_control(control(tag, command.value, service, request_id, header, payload or []), tag, commands)


def typed(tag: bytes, msg: Message):
    """``msg``'s header typed as the broker's loop types it before calling a handler."""
    if tag == CLIENT_TAG:
        return typed_header(msg, CLIENT_HEADERS[ClientCommand(msg.command)])
    return typed_header(msg, WORKER_HEADERS[WorkerCommand(msg.command)])


def handle(handler, state, now: float, tag: bytes, command, request_id: bytes = b"", header: dict | None = None,
           **kw) -> None:
    """Call a broker ``handler`` with the message a peer in ``state`` sent, its header typed."""
    msg = message(tag, command, request_id, header, **kw)
    handler(state, msg, typed(tag, msg), now)


def make_router(**kw) -> Router:
    """A Router over a Recorder (``router.recorder``)."""
    recorder = Recorder()
    router = Router(recorder, **{"heartbeat_interval": 1.0, "liveness": 3, "max_message_bytes": 1 << 20, **kw})
    router.recorder = recorder  # type: ignore[attr-defined]
    return router


def ready(router: Router, identity: bytes, now: float, capacity: int = 1, info: dict | None = None,
          service: str = SERVICE, **header) -> None:
    header = {"target_info": info or TARGET_INFO, "capacity": capacity, **header}
    handle(router.worker_ready, identity, now, WORKER_TAG, WorkerCommand.READY, header=header, service=service)


def submit(router: Router, client: bytes, now: float, timeout: float = 30.0, service: str = SERVICE,
           payload: list | None = None, **header) -> bytes:
    request_id = new_request_id()
    state = router.client_seen(client, now)
    header = {"reply_to": "tcp://127.0.0.1:9", "timeout": timeout, **header}
    handle(router.enqueue, state, now, CLIENT_TAG, ClientCommand.REQUEST, request_id, header, service=service,
           payload=payload)
    return request_id


def done(router: Router, worker: bytes, request_id: bytes, now: float, status: str = "ok", **header) -> None:
    seen = router.worker_seen(worker, now)
    assert seen is not None
    handle(router.complete, seen, now, WORKER_TAG, WorkerCommand.DONE, request_id, {"status": status, **header})


def keep_alive(router: Router, now: float, *peers: bytes) -> None:
    """Every peer in ``peers`` (worker or client) sent a heartbeat at ``now``."""
    for peer in peers:
        if router.worker_seen(peer, now) is None:
            router.client_seen(peer, now)
