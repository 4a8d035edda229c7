"""The frame-count caps, by value: each receiver takes a message of exactly its kind's cap of frames and
refuses one of a frame more, for every kind of message it may be sent.

The caps are written out here, from what the largest honest message of each kind has (not computed by
the code under test), so a cap that grows or shrinks fails. Each receiver is the real one: the broker's
two sockets, a worker's broker session, a client's broker socket and data socket, read by the
``BoundedReader`` each builds, over loopback TCP. Socket-free but for those; nothing runs a loop.
"""

from __future__ import annotations

import time
import uuid

import pytest
import torch
import zmq

from spec_serve.broker.server import Broker
from spec_serve.client.io_thread import ClientIO
from spec_serve.protocol import wire
from spec_serve.protocol.commands import (
    CLIENT_TAG,
    DATA_TAG,
    PART_BYTES,
    WORKER_TAG,
    ClientCommand,
    Status,
    WorkerCommand,
    control,
    in_parts,
)
from spec_serve.transport.bounded import BoundedReader, Overlong
from spec_serve.worker.session import BrokerSession

# Every control message: tag, command, service, request id, header.
CONTROL = 5
# A client's REQUEST, SET_VOCAB and PART carry at most 16 payload frames (protocol.commands.in_parts).
CLIENT_PAYLOAD = 16
# The worker's largest request here: 1 MiB, which reaches it as the broker joined its parts: at most 16 frames
# a part, 1 MiB / 256 KiB = 4 full parts, plus one for the codec's header frame and one for a partial part.
WORKER_MAX_MESSAGE_BYTES = 1 << 20
WORKER_PAYLOAD = 16 * (4 + 2)
# A reply: tag, status, request id, header; the codec's header frame, at most 16 tensors, and a tensor of more
# than 1 MiB split in frames of 1 MiB: at 64 MiB, 64 more.
CLIENT_MAX_MESSAGE_BYTES = 64 << 20
REPLY = 4 + 1 + 16 + 64

CLIENT_PAYLOAD_COMMANDS = {ClientCommand.REQUEST, ClientCommand.SET_VOCAB, ClientCommand.PART}
WORKER_PAYLOAD_COMMANDS = {WorkerCommand.REQUEST, WorkerCommand.SET_VOCAB}


class Receivers:
    """The real receivers, each with a peer socket connected to it: (peer, reader, prefix) by name."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.broker = Broker("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", context=self.ctx)
        to_frontend = self._peer(zmq.DEALER, connect=self.broker.frontend_endpoint)
        to_backend = self._peer(zmq.DEALER, connect=self.broker.backend_endpoint)
        # A broker for the worker session and the client to talk to: a ROUTER the test drives.
        self.fake_broker = self._peer(zmq.ROUTER, bind="tcp://127.0.0.1:*")
        self.reached: set[bytes] = set()  # identities whose message reached the fake broker
        url = self.fake_broker.getsockopt_string(zmq.LAST_ENDPOINT)
        self.session = BrokerSession(
            self.ctx, uuid.uuid4().bytes, "w", url, "svc", security=None, info={}, capacity=1,  # type: ignore[arg-type]  # never sent
            max_message_bytes=WORKER_MAX_MESSAGE_BYTES, heartbeat_interval=1.0, liveness=3, handlers={},
            before_ready=lambda: False)
        self.session.open(zmq.Poller())
        self.session.keep_alive(time.monotonic() + 1.0)  # a heartbeat (it does not register: before_ready)
        self.client = ClientIO(url, security=None, advertise_host="127.0.0.1", max_retries=0, heartbeat_interval=1.0,
                               liveness=3, max_message_bytes=CLIENT_MAX_MESSAGE_BYTES, device=torch.device("cpu"))
        sockets = self.client.sockets
        assert sockets.dealer is not None and sockets.data is not None
        to_data = self._peer(zmq.PUSH, connect=self.client.data_endpoint)
        sockets.dealer.send_multipart(control(CLIENT_TAG, ClientCommand.HEARTBEAT.value))
        self.session_route = self._route(self.session.identity)
        self.client_route = self._route(self.client.identity)
        self.by_name = {
            "broker.frontend": (to_frontend, self.broker.readers[self.broker.frontend], []),
            "broker.backend": (to_backend, self.broker.readers[self.broker.backend], []),
            "worker.broker": (self.fake_broker, self.session._reader, [self.session_route]),
            "client.broker": (self.fake_broker, sockets._readers[sockets.dealer], [self.client_route]),
            "client.data": (to_data, sockets._readers[sockets.data], []),
        }

    def _peer(self, kind: int, *, connect: str | None = None, bind: str | None = None) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        if kind == zmq.ROUTER:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if connect:
            sock.connect(connect)
        if bind:
            sock.bind(bind)
        return sock

    def _route(self, identity: bytes) -> bytes:
        """Wait for the peer ``identity`` (a READY, a heartbeat) at the fake broker, so sends reach it."""
        # Remembered across calls: one peer's message may arrive while we wait for the other's, and each sends
        # only one.
        deadline = time.monotonic() + 10
        while identity not in self.reached and time.monotonic() < deadline:
            if self.fake_broker.poll(100):
                self.reached.add(self.fake_broker.recv_multipart()[0])
        if identity not in self.reached:
            raise AssertionError("the peer never reached the fake broker")
        return identity

    def close(self) -> None:
        for ingress in self.broker.ingress.values():
            ingress.close()
        self.session.close(0)
        self.client.sockets.release()  # the client's thread never started: close its sockets and pipe here
        self.client._close_pipe()
        self.ctx.destroy(0)


@pytest.fixture(scope="module")
def receivers():
    made = Receivers()
    yield made
    made.close()


def _frames(head: list[bytes], count: int) -> list[bytes]:
    return [*head, *[b""] * (count - len(head))]


def _read(reader: BoundedReader) -> list | Overlong:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        got = reader.read()
        if got is not None:
            return got
        reader.sock.poll(50)
    raise AssertionError("nothing arrived")


def _cases():
    rid = uuid.uuid4().bytes
    for command in ClientCommand:
        cap = CONTROL + (CLIENT_PAYLOAD if command in CLIENT_PAYLOAD_COMMANDS else 0)
        yield "broker.frontend", [CLIENT_TAG, command.value, b"svc", rid, b"{}"], cap
        yield "client.broker", [CLIENT_TAG, command.value, b"svc", rid, b"{}"], CONTROL
    for command in WorkerCommand:
        yield "broker.backend", [WORKER_TAG, command.value, b"svc", rid, b"{}"], CONTROL
        cap = CONTROL + (WORKER_PAYLOAD if command in WORKER_PAYLOAD_COMMANDS else 0)
        yield "worker.broker", [WORKER_TAG, command.value, b"svc", rid, b"{}"], cap
    for status in Status:
        yield "client.data", [DATA_TAG, status.value, rid, b"{}"], REPLY


CASES = list(_cases())


@pytest.mark.parametrize("receiver, head, cap", CASES,
                         ids=[f"{r}-{h[1].hex()}-{c}" for r, h, c in CASES])
def test_cap_frames_are_taken_and_one_more_is_refused(receivers, receiver, head, cap):
    """Exactly ``cap`` frames: read whole. ``cap + 1``: refused (an ``Overlong`` holding ``cap`` frames), its
    rest thrown away unread. The refusal's cut of the connection comes later, on the watcher's thread: the
    next case's messages may find it reconnected, or be read before the cut, either way whole."""
    peer, reader, route = receivers.by_name[receiver]
    skip = 1 if receiver.startswith("broker.") else 0  # a ROUTER's identity frame
    peer.send_multipart([*route, *_frames(head, cap)])
    taken = _read(reader)
    assert not isinstance(taken, Overlong) and len(taken) - skip == cap
    peer.send_multipart([*route, *_frames(head, cap + 1)])
    refused = _read(reader)
    assert isinstance(refused, Overlong) and refused.limit == cap and len(refused.frames) - skip == cap


def test_the_largest_honest_messages_fit_their_caps():
    """The caps above are no smaller than what honest peers send: a client's largest part, and the broker's
    join of a worker's largest request (every part's frames), and a reply of 16 tensors at the client's limit."""
    payload = wire.encode({"input_ids": torch.zeros(WORKER_MAX_MESSAGE_BYTES // 8 - 4096, dtype=torch.int64)})
    parts = in_parts(control(CLIENT_TAG, ClientCommand.REQUEST.value, "svc", uuid.uuid4().bytes, {}, payload))
    assert max(len(part) for part in parts) <= CONTROL + CLIENT_PAYLOAD
    assert len(parts) == WORKER_MAX_MESSAGE_BYTES // PART_BYTES  # it did go in parts
    assert sum(len(part) - CONTROL for part in parts) <= WORKER_PAYLOAD
    tensors = {f"t{i}": torch.zeros(4, dtype=torch.float32) for i in range(15)}
    tensors["big"] = torch.zeros((CLIENT_MAX_MESSAGE_BYTES - (1 << 20)) // 4, dtype=torch.float32)
    assert 4 + len(wire.encode(tensors)) <= REPLY
