"""Reply delivery, on the I/O thread: each reply goes straight to its client's data socket, and the
broker hears DONE as soon as ZeroMQ took it (or it proved undeliverable), so the slot frees at once.

A reply may borrow memory until it has left (its path's ``Loan``: a pooled host slab goes back once ZeroMQ let
go of every frame, or a lent slot, cancelled if the reply is dropped).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable

import zmq

from spec_serve.paths.base import Loan
from spec_serve.protocol.commands import DoneStatus, data_message
from spec_serve.protocol.messages import Done
from spec_serve.telemetry.logs import event
from spec_serve.transport.sockets import Security, make_socket, send_lent
from spec_serve.worker.jobs import Result, done_status

log = logging.getLogger("spec_serve.worker")

# Client data sockets kept open, and how long an unused one lives.
MAX_DATA_SOCKETS = 64
DATA_SOCKET_IDLE_S = 120.0
# Replies a client's data socket queues (ZeroMQ SNDHWM); further ones wait in the Outbox until one leaves.
DATA_SOCKET_HWM = 4
# A reply waits this long for a new data socket's connection; after that, a socket that takes nothing while
# none of our replies queue there makes the reply undeliverable at once (it is refused or not read).
CONNECT_GRACE_S = 2.0

SendDone = Callable[[bytes, Done], None]  # tell the broker DONE: (request id, DONE header)


@dataclasses.dataclass
class ReplySocket:
    """A PUSH socket to one client's data endpoint, and the replies it has not yet sent."""

    sock: zmq.Socket
    created: float
    used: float
    unsent: collections.deque = dataclasses.field(default_factory=collections.deque)  # (tracker, handed at)
    closed: bool = False

    def queued(self) -> int:
        """Replies handed to ZeroMQ that have not left this process yet."""
        while self.unsent and self.unsent[0][0].done:
            self.unsent.popleft()
        return len(self.unsent)

    def oldest_unsent(self, now: float) -> float:
        """Seconds the oldest reply handed to ZeroMQ has waited to leave (0 when all have)."""
        return now - self.unsent[0][1] if self.queued() else 0.0

    def close(self, linger_ms: int = 0) -> None:
        # LINGER 0: ZeroMQ drops what it still queues, so every tracker of this socket completes and the
        # slabs those replies borrow go back to the pool (Outbox.flush releases them). A worker whose
        # engine died, exiting, lingers instead: its last (error) replies must still leave.
        self.closed = True
        self.sock.close(linger_ms)


class DataSockets:
    """The open data sockets, by client endpoint, least recently used first."""

    def __init__(self, ctx: zmq.Context, security: Security | None, reply_timeout: float):
        self.ctx = ctx
        self.security = security
        self.reply_timeout = reply_timeout  # a data socket whose oldest reply has not left by then is closed
        self._sockets: collections.OrderedDict[str, ReplySocket] = collections.OrderedDict()

    def get(self, endpoint: str, server_key: str | None, now: float) -> ReplySocket:
        """The socket to ``endpoint`` (connected now if new, under the request's ``data_key``, ``server_key``)."""
        entry = self._sockets.get(endpoint)
        if entry is None:
            # immediate: replies queue only on a connection that completed its handshake, so an endpoint
            # that refuses (or never completes one) takes nothing and its replies fail at once.
            sock = make_socket(self.ctx, zmq.PUSH, connect=endpoint, security=self.security, hwm=DATA_SOCKET_HWM,
                               curve_server_key=server_key.encode() if server_key else None, immediate=True)
            entry = self._sockets[endpoint] = ReplySocket(sock, created=now, used=now)
            while len(self._sockets) > MAX_DATA_SOCKETS:
                self._sockets.popitem(last=False)[1].close()
        entry.used = now
        self._sockets.move_to_end(endpoint)
        return entry

    def close_idle(self, now: float) -> None:
        """Close data sockets unused for DATA_SOCKET_IDLE_S, and any whose oldest reply has not left
        within ``reply_timeout`` (a client that stopped reading): that frees what it borrows."""
        for endpoint, reply_socket in list(self._sockets.items()):
            stuck = reply_socket.oldest_unsent(now) > self.reply_timeout
            if stuck or now - reply_socket.used > DATA_SOCKET_IDLE_S:
                self._sockets.pop(endpoint).close()
            if stuck:
                event(log, logging.WARNING, "worker.reply_stuck", endpoint=endpoint[:80],
                      unsent=len(reply_socket.unsent))

    def unsent(self, now: float) -> int:
        """Replies handed to ZeroMQ that have not left this process yet (closing their sockets drops them)."""
        return sum(len(s.unsent) for s in self._sockets.values() if s.oldest_unsent(now) > 0.0)

    def close_all(self, linger_ms: int) -> None:
        for reply_socket in self._sockets.values():
            reply_socket.close(linger_ms)


class Outbox:
    """Replies waiting to be handed to ZeroMQ, and the loans of those ZeroMQ still sends from."""

    def __init__(self, sockets: DataSockets, send_done: SendDone):
        self.sockets = sockets
        self.send_done = send_done
        self._waiting: collections.deque[tuple[ReplySocket, Result]] = collections.deque()
        self._tracked: list[tuple[zmq.MessageTracker, Loan]] = []  # sent replies still borrowing memory
        self.served = 0
        self.replies: collections.Counter[str] = collections.Counter()  # sent, by path (DONE's ``via``)

    @property
    def busy(self) -> bool:
        """True while a reply waits to be handed over, or a sent one still holds a slab."""
        return bool(self._waiting or self._tracked)

    @property
    def empty(self) -> bool:
        return not self._waiting

    def add(self, result: Result, now: float) -> None:
        """Queue ``result`` for its client's data socket; a ``reply_to`` no socket takes is undeliverable."""
        endpoint, server_key = result.job.reply_route
        try:
            sock = self.sockets.get(endpoint, server_key, now)
        except Exception as e:  # a reply_to or data_key no socket takes: no one to answer
            event(log, logging.WARNING, "worker.bad_reply_to", endpoint=str(endpoint)[:80], error=e)
            result.drop()
            self.send_done(result.job.request_id, Done(status=DoneStatus.UNDELIVERABLE, error=f"bad endpoint: {e}"))
            return
        self._waiting.append((sock, result))

    def flush(self, now: float) -> None:
        """Hand ready replies to ZeroMQ without blocking and tell the broker DONE at once: the slot is
        free whether the reply went out or was undeliverable (dropped; the broker tells the client)."""
        self._release_sent()
        for _ in range(len(self._waiting)):
            reply_socket, result = self._waiting.popleft()
            if result.out.ready is not None and not result.out.ready.query():
                self._waiting.append((reply_socket, result))  # its device->host copy is still running
                continue
            sent = self._hand_off(reply_socket, result, now)
            if sent is None:
                self._waiting.append((reply_socket, result))  # its socket is still connecting
                continue
            self.send_done(result.job.request_id, Done(
                status=done_status(result) if sent else DoneStatus.UNDELIVERABLE, tokens=result.tokens,
                nbytes=result.nbytes, via=result.out.via,
                error=None if sent else "its data socket takes nothing (the endpoint refuses, or nothing reads it)"))
            self.served += 1

    def _release_sent(self) -> None:
        """Give back what replies borrow once ZeroMQ has let go of every frame of theirs."""
        if self._tracked:
            still = []
            for tracker, loan in self._tracked:
                if tracker.done:
                    loan.left()
                else:
                    still.append((tracker, loan))
            self._tracked = still

    def _hand_off(self, reply_socket: ReplySocket, result: Result, now: float) -> bool | None:
        """Give a reply to ZeroMQ: True if taken, False if undeliverable (dropped), None to retry shortly."""
        if not reply_socket.closed:
            frames = data_message(result.status, result.job.request_id, result.reply, result.frames)
            try:
                # One tracker over every frame (not the last frame's alone, which pyzmq may have copied and
                # finished at once): a slab goes back, and a reply counts as sent, only once all have left.
                tracker = send_lent(reply_socket.sock, frames, zmq.NOBLOCK)
            except zmq.Again:
                # Full of our own replies (SNDHWM) is a client reading slower than we answer, not one that takes
                # nothing: wait (DataSockets.close_idle closes the socket if its oldest stops moving).
                if reply_socket.queued() or now - reply_socket.created < CONNECT_GRACE_S:
                    return None
            else:
                reply_socket.unsent.append((tracker, now))
                if result.out.loan is not None:
                    self._tracked.append((tracker, result.out.loan))
                self.replies[result.out.via] += 1
                return True
        result.drop()
        event(log, logging.INFO, "worker.reply_undeliverable", request=result.job.request_id.hex()[:12])
        return False
