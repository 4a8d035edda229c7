"""The client's two sockets, owned by its I/O thread: a DEALER to the broker (replaced by a fresh one when the
broker link says so) and the PULL that workers push replies to, each read frame by frame (a message with more
frames than its kind has is refused), and the ipc socket files they leave behind."""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable

import zmq

from spec_serve.client.stats import ClientStats
from spec_serve.protocol import wire
from spec_serve.protocol.commands import ProtocolError, frame_limit, in_parts, reply_frame_limit
from spec_serve.telemetry.logs import Throttle, event
from spec_serve.transport.bounded import BoundedReader, Overlong
from spec_serve.transport.connwatch import ConnectWatch, connect_watched
from spec_serve.transport.ingress import Ingress
from spec_serve.transport.sockets import (
    KeyPolicy,
    Security,
    bound_endpoint,
    make_socket,
    route_address,
    tcp_endpoint,
)

log = logging.getLogger("spec_serve.client")


def _ipc_endpoint() -> str:
    return f"ipc://{os.environ.get('TMPDIR', '/tmp')}/spec-serve-{uuid.uuid4().hex}.sock"


class ClientSockets:
    """The DEALER (``dealer``) and the data PULL (``data``). ``reply_room()``: the bytes the data socket may
    hold undelivered (read by its ingress watcher thread)."""

    def __init__(self, ctx: zmq.Context, identity: bytes, broker_url: str, *, security: Security | None,
                 advertise_host: str | None, max_message_bytes: int, stats: ClientStats,
                 reply_room: Callable[[], int]):
        self.ctx, self.identity, self.broker_url, self.security = ctx, identity, broker_url, security
        self.max_message_bytes, self.stats = max_message_bytes, stats
        # The DEALER's connection, watched while it lives: before a broker answers, why none does (``cause``);
        # after, each connection that ends (``dropped``).
        self.watch: ConnectWatch
        self.data: zmq.Socket | None = None
        self.dealer: zmq.Socket | None = None
        self.data_ingress: Ingress | None = None
        self._readers: dict[zmq.Socket, BoundedReader] = {}
        self._refusal_log = Throttle(60.0)
        self._ipc_files: list[str] = []
        try:
            self._open(broker_url, security, advertise_host, reply_room)
        except BaseException:
            self.release()  # a constructor that raises leaks no descriptor
            raise

    def _open(self, broker_url: str, security: Security | None, advertise_host: str | None,
              reply_room: Callable[[], int]) -> None:
        # Where peers reach us: the data socket, and a reply path's connections to a worker we hold.
        local = broker_url.startswith("ipc://")
        self.local_host = "127.0.0.1" if local else advertise_host or route_address(broker_url)
        data_bind = _ipc_endpoint() if local else tcp_endpoint(self.local_host, "*")
        # With CURVE, only the workers' keys may push replies here (none without worker_keys_dir).
        self.data_keys = KeyPolicy(security.worker_keys_dir) if security else None
        self.data = make_socket(self.ctx, zmq.PULL, security=security, admit=self.data_keys)
        # Workers may push at most the replies we wait for (and one late duplicate) before we see them whole.
        self.data_ingress = Ingress(self.data, "client.data", total=reply_room, bind=data_bind)
        self._readers[self.data] = BoundedReader(self.data, lambda head: reply_frame_limit(self.max_message_bytes),
                                                 ingress=self.data_ingress)
        self.data_endpoint = bound_endpoint(self.data)
        if data_bind.startswith("ipc://"):
            self._ipc_files.append(data_bind[len("ipc://"):])
        self.data_key = security.keypair()[0].decode() if security else None
        self.dealer = self.connect()

    def connect(self) -> zmq.Socket:
        """A fresh DEALER to the broker, watched."""
        # No send high-water mark: a large request goes as many parts (protocol.commands.in_parts), all
        # queued at once; they are views of payloads this client holds anyway (credits bound those).
        sock = make_socket(self.ctx, zmq.DEALER, identity=self.identity, security=self.security, hwm=0)
        sock.setsockopt(zmq.RCVHWM, 64)
        # Only the broker sends here, control messages only.
        self._readers = {s: r for s, r in self._readers.items() if s is self.data}
        self._readers[sock] = BoundedReader(sock, lambda head: frame_limit(head, 0))
        self.watch = connect_watched(sock, self.broker_url, "client")
        return sock

    def reconnect(self, poller: zmq.Poller) -> None:
        """Lazy Pirate: the broker went silent; a fresh DEALER in the old one's place, watched by ``poller``."""
        assert self.dealer is not None  # opened in __init__
        poller.unregister(self.dealer)
        self.watch.close()
        self.dealer.close(0)
        self.dealer = self.connect()
        poller.register(self.dealer, zmq.POLLIN)

    def dropped(self) -> int:
        """Connections to the broker that ended since the last call (libzmq reconnects; what was midway is lost)."""
        return self.watch.read_disconnects()

    def send(self, frames: list) -> None:
        """A control message to the broker (a large payload in parts, protocol.commands.in_parts)."""
        assert self.dealer is not None  # opened in __init__
        try:
            for part in in_parts(frames):
                self.dealer.send_multipart(part, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            pass  # not connected or saturated: timeouts and heartbeats recover

    def drain(self, sock: zmq.Socket, handler: Callable[[list], None]) -> None:
        """Hand ``sock``'s waiting messages to ``handler`` (64 at most a turn); whatever a peer sends, the
        I/O thread lives on."""
        for _ in range(64):
            frames = self._readers[sock].read()
            if frames is None:  # nothing more now, or a refused message still being thrown away
                return
            if isinstance(frames, Overlong):
                self._refuse(sock, frames)
                continue
            try:
                handler(frames)
            except (ProtocolError, wire.WireError) as e:
                event(log, logging.WARNING, "client.bad_message", error=e)
            except Exception as e:
                log.exception("client.handler_failed error=%s", e)

    def _refuse(self, sock: zmq.Socket, overlong: Overlong) -> None:
        """A message with more frames than its kind has (a reply, or a broker message): count it, and cut the
        connection it came from if that was one to the data socket (a stranger's; workers never send it)."""
        self.stats.refused_messages += 1
        why = f"a message of more than {overlong.limit} frames, more than its kind has"
        if sock is self.data and self.data_ingress is not None:
            self.data_ingress.cut(overlong.source_fd, why)
        side = "data" if sock is self.data else "broker"
        held = self._refusal_log.ready(side, time.monotonic())
        if held is not None:
            event(log, logging.WARNING, "client.refused_message", socket=side, reason=why, similar_since_last=held)

    def close(self) -> None:
        """The I/O thread ends: let a final DISCONNECT leave, close both sockets and unlink their files."""
        self.watch.close()
        assert self.dealer is not None  # opened in __init__
        self.dealer.close(linger=500)
        self.release()

    def release(self) -> None:
        """Close whatever was opened, at once (a constructor that failed; the rest of ``close``)."""
        if self.data_ingress is not None:
            self.data_ingress.close()
        for sock in (self.dealer, self.data):
            if sock is not None:
                sock.close(0)
        self._unlink_ipc_files()

    def _unlink_ipc_files(self) -> None:
        for path in self._ipc_files:  # libzmq leaves a named ipc socket's file behind
            with contextlib.suppress(OSError):
                os.unlink(path)
