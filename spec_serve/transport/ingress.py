"""Bound the bytes a TCP peer can make libzmq hold before the application sees them.

libzmq hands a multipart message over only once its last frame has arrived, and checks sizes per
frame only (``MAXMSGSIZE``). A peer that sends frame after frame without ending the message makes
the receiver hold all of it, and reading frame by frame (``RCVMORE``) cannot help: nothing is
readable before the last frame. So the bound is kept below libzmq. One watcher thread per process
learns every TCP connection of a watched socket from the socket monitor, reads how many bytes libzmq
has read from it (the kernel's ``TCP_INFO`` ``tcpi_bytes_received`` less its unread queue, ``FIONREAD``),
and subtracts what the socket's owner was handed from that connection (every message names its
connection, ``ZMQ_SRCFD``).
A connection whose unaccounted bytes pass ``per_connection``, or the largest one when a socket's
connections together pass ``total``, is shut down, and libzmq frees the partial message with it.
A connection the owner is still draining (a message of it was delivered since the check before) is
spared: its bytes may be whole messages waiting in libzmq's queue. A message that never ends stops
every delivery from its connection (a connection is one ordered stream), so it is never spared.

Invariant, checked every ``CHECK_INTERVAL_S``: a connection that is not draining holds at most
``per_connection + GRANT_BYTES`` bytes that were not delivered, plus what arrives within two checks
(the link's rate times the interval); a socket at most ``total`` plus the same. Bytes that are
never delivered (ZMTP handshakes and heartbeats) are forgiven up to ``GRANT_BYTES`` each time the
connection delivers a message. Only TCP is watched: ``ipc://`` sockets have no byte counter (their
file mode admits only the owner's user).

An owner that says when it waits in its poll (``waiting``) is not blamed on its peers: while it has
been busy since before the last check (a long handler, a descheduled process), whole messages may
wait unread behind it, so connections are cut only past ``STALLED_FACTOR`` times the bounds. Once it
polls again, a connection that holds too much and delivered nothing holds part of a message.
"""

from __future__ import annotations

import collections
import dataclasses
import fcntl
import logging
import select
import socket
import struct
import termios
import threading
import time
from collections.abc import Callable
from typing import Any, TypeAlias, TypeVar

import zmq
from zmq.utils.monitor import parse_monitor_message

from spec_serve.telemetry.logs import event

log = logging.getLogger("spec_serve.ingress")

CHECK_INTERVAL_S = 0.01
# While the owner is busy, the bounds stretch this many times (it may just be slow to read whole messages).
STALLED_FACTOR = 8
# Unaccounted bytes (handshake, ZMTP heartbeats) forgiven per delivered message.
GRANT_BYTES = 64 << 10
_TCP_INFO_LEN = 136
_BYTES_RECEIVED_OFFSET = 128  # struct tcp_info.tcpi_bytes_received (Linux >= 4.1)
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
# Bytes arriving on a descriptor wake its EPOLLIN waiters, but epoll reports an edge only if the descriptor is
# still ready when asked, and libzmq has usually read them by then. A TCP socket is writable, so asking for
# EPOLLOUT too reports every such wake-up.
_ARRIVALS = select.EPOLLIN | select.EPOLLOUT | select.EPOLLET
# A CURVE frame travels as a MESSAGE command: 8-byte name, 8-byte nonce, 16-byte MAC, 1 flags byte.
_CURVE_FRAME_OVERHEAD = 33


def wire_bytes(nbytes: int, curve: bool) -> int:
    """Bytes one frame of ``nbytes`` occupies on a ZMTP 3 connection (NULL or CURVE)."""
    body = nbytes + (_CURVE_FRAME_OVERHEAD if curve else 0)
    return body + (2 if body <= 255 else 9)


Budget: TypeAlias = "int | Callable[[], int]"


@dataclasses.dataclass
class _Conn:
    fd: int
    peer: tuple[Any, ...]
    base: int  # received - delivered bytes already accounted for (forgiven)
    seen: int  # delivered message count at the last check
    held: int = 0  # undelivered bytes at the last check
    draining: bool = False  # a message was delivered since the check before


class Ingress:
    """The bound on one socket. The owner thread calls ``delivered`` with every message it receives
    (``copy=False`` frames) and ``close`` before closing the socket.

    Give the socket's ``bind``/``connect`` endpoint here rather than to ``make_socket``: the monitor
    must be in place before the first connection, or that connection goes unwatched. If binding or
    connecting fails, the socket is closed.
    """

    def __init__(self, sock: zmq.SyncSocket, name: str, *, total: Budget, per_connection: Budget | None = None,
                 router: bool = False, bind: str | None = None, connect: str | None = None) -> None:
        self.name = name
        self.total = total
        self.per_connection = total if per_connection is None else per_connection
        self.router = router
        self.curve = sock.getsockopt(zmq.MECHANISM) == zmq.CURVE
        self.dropped = 0  # connections shut down for holding too much
        # fd -> delivered bytes / messages; written by the owner thread only, read by the watcher.
        self.bytes: dict[int, int] = {}
        self.count: dict[int, int] = {}
        self._sock = sock
        # Watcher thread only: fd -> (bytes, messages) delivered through connections on it that have ended.
        self._retired: dict[int, tuple[int, int]] = {}
        self._cuts: collections.deque[tuple[int, tuple[Any, ...] | None, str]] = collections.deque()
        # Owner progress (``waiting``): polls entered, whether it is in one now; None: not reported.
        self._polls: int | None = None
        self._in_poll = False
        self._polls_seen = 0
        self._closed = threading.Event()
        self._closed_ack = threading.Event()
        _watcher().add(self, sock.get_monitor_socket(_EVENTS))
        try:
            if bind is not None:
                sock.bind(bind)
            if connect is not None:
                sock.connect(connect)
        except BaseException:  # as make_socket: a bad endpoint must not leak the socket
            self.close()
            sock.close(0)
            raise

    def delivered(self, frames: list[zmq.Frame]) -> None:
        """Account one received message (a ROUTER's identity frame is not on the wire)."""
        parts = frames[1:] if self.router else frames
        if not parts:
            return
        fd = parts[-1].get(zmq.SRCFD)
        self.bytes[fd] = self.bytes.get(fd, 0) + sum(wire_bytes(len(p), self.curve) for p in parts)
        self.count[fd] = self.count.get(fd, 0) + 1

    def waiting(self, now_waiting: bool) -> None:
        """Owner thread: it enters (True) or leaves (False) the poll that waits for this socket."""
        if now_waiting:
            self._polls = (self._polls or 0) + 1
        self._in_poll = now_waiting

    def responsive(self) -> bool:
        """Watcher thread, once a check: the owner waited in its poll since the check before (or is in it now),
        so what a connection holds undelivered is not whole messages the owner had no time to read."""
        polls = self._polls
        if polls is None:
            return True
        moved, self._polls_seen = polls != self._polls_seen, polls
        return moved or self._in_poll

    def cut(self, fd: int | None, reason: str) -> None:
        """Shut down the connection on descriptor ``fd`` (a message's ``ZMQ_SRCFD``) at the watcher's next
        check, e.g. one that sent a message the owner refused; any thread. Its peer address is taken now,
        so a connection that takes the descriptor over later is spared."""
        if fd is None:
            return
        self._cuts.append((fd, _borrow(fd, socket.socket.getpeername), reason))
        _watcher().wake()

    def close(self) -> None:
        """Stop watching (owner thread, before the socket closes); returns once the monitor is closed."""
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._closed.set()
        _watcher().wake()
        self._closed_ack.wait(1.0)

    def limit(self, budget: Budget) -> int:
        return budget() if callable(budget) else budget


_T = TypeVar("_T")


def _borrow(fd: int, use: Callable[[socket.socket], _T]) -> _T | None:
    """``use(sock)`` on libzmq's descriptor ``fd`` without taking it over; None if ``fd`` is not a socket
    (any more) or the call fails."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        return use(sock)
    except OSError:
        return None
    finally:
        sock.detach()  # the descriptor stays libzmq's


def _received(sock: socket.socket) -> int | None:
    """Bytes libzmq has read from a TCP socket: what the kernel received less what still waits in its
    receive queue (kernel memory, bounded by the socket's buffer; libzmq may lag behind a burst). None for
    any other kind of socket."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        return None
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
    if len(info) < _TCP_INFO_LEN:
        return None
    unread: int = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
    received: int = struct.unpack_from("<Q", info, _BYTES_RECEIVED_OFFSET)[0]
    return received - unread


def _shutdown_if(peer: tuple[Any, ...]) -> Callable[[socket.socket], bool]:
    """Shut the connection down (libzmq then closes it) if it is still the one to ``peer``."""
    def shutdown(sock: socket.socket) -> bool:
        if sock.getpeername() != peer:
            return False
        sock.shutdown(socket.SHUT_RDWR)
        return True
    return shutdown


class _Watcher(threading.Thread):
    """Polls every watched socket's monitor and checks its connections each ``CHECK_INTERVAL_S``.

    Only connections that received bytes (an edge-triggered epoll on libzmq's descriptors) or
    delivered a message since the last check cost a ``TCP_INFO`` call; every connection is swept
    once a second regardless.
    """

    def __init__(self) -> None:
        super().__init__(name="spec-serve-ingress", daemon=True)
        self._lock = threading.Lock()
        self._added: list[tuple[Ingress, zmq.SyncSocket]] = []
        self._watched: dict[Ingress, tuple[zmq.SyncSocket, dict[int, _Conn]]] = {}
        self._poke = threading.Event()
        self._epoll = select.epoll()
        self._owners: dict[int, _Conn] = {}  # fd -> the connection it is now (descriptors are reused)
        self._next_sweep = 0.0

    def add(self, ingress: Ingress, monitor: zmq.SyncSocket) -> None:
        with self._lock:  # also publishes the monitor socket to this thread
            self._added.append((ingress, monitor))

    def wake(self) -> None:
        self._poke.set()

    def run(self) -> None:
        poller = zmq.Poller()
        while True:
            try:
                self._round(poller)
            except Exception:  # a bug here must not end the watching
                log.exception("ingress.watcher_failed")
                time.sleep(CHECK_INTERVAL_S)

    def _round(self, poller: zmq.Poller) -> None:
        with self._lock:
            added, self._added = self._added, []
        for ingress, monitor in added:
            self._watched[ingress] = (monitor, {})
            poller.register(monitor, zmq.POLLIN)
        if self._watched:
            ready = dict(poller.poll(int(CHECK_INTERVAL_S * 1000)))  # what pyzmq does with a float
        else:
            self._poke.wait(CHECK_INTERVAL_S)
            ready = {}
        self._poke.clear()
        dirty = {fd for fd, _ in self._epoll.poll(0)}
        sweep = time.monotonic() >= self._next_sweep
        if sweep:
            self._next_sweep = time.monotonic() + 1.0
        for ingress, (monitor, conns) in list(self._watched.items()):
            if ingress._closed.is_set():
                for conn in list(conns.values()):
                    self._forget(ingress, conns, conn)
                poller.unregister(monitor)
                monitor.close(0)
                del self._watched[ingress]
                ingress._closed_ack.set()
                continue
            if monitor in ready:
                self._events(ingress, monitor, conns)
            self._check(ingress, conns, dirty, sweep)

    def _events(self, ingress: Ingress, monitor: zmq.SyncSocket, conns: dict[int, _Conn]) -> None:
        while True:
            try:
                msg = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            fd = msg["value"]
            if msg["event"] in (zmq.EVENT_ACCEPTED, zmq.EVENT_CONNECTED):
                peer = _borrow(fd, socket.socket.getpeername)
                if peer is not None and _borrow(fd, _received) is not None:
                    # Counted from the connection's first byte: a flood that began before this event is not forgiven,
                    # and what the owner was handed from it before is its own (only an ended connection's is not).
                    delivered, count = ingress._retired.get(fd, (0, 0))
                    conn = conns[fd] = self._owners[fd] = _Conn(fd, peer, -delivered, count)
                    self._listen(fd)
                    conn.held = -1  # checked in this round
            elif fd in conns:
                self._forget(ingress, conns, conns[fd])

    def _listen(self, fd: int) -> None:
        try:
            self._epoll.register(fd, _ARRIVALS)
        except FileExistsError:  # a reused descriptor whose old registration is still there
            self._epoll.modify(fd, _ARRIVALS)
        except OSError:  # already closed: the sweep still finds nothing to check
            pass

    def _forget(self, ingress: Ingress, conns: dict[int, _Conn], conn: _Conn) -> None:
        """Stop watching ``conn``; what was delivered through its descriptor so far is not the next one's."""
        conns.pop(conn.fd, None)
        ingress._retired[conn.fd] = (ingress.bytes.get(conn.fd, 0), ingress.count.get(conn.fd, 0))
        if self._owners.get(conn.fd) is conn:  # not if the descriptor already serves a newer connection
            del self._owners[conn.fd]
            try:
                self._epoll.unregister(conn.fd)
            except OSError:
                pass

    def _check(self, ingress: Ingress, conns: dict[int, _Conn], dirty: set[int], sweep: bool) -> None:
        while ingress._cuts:
            fd, peer, why = ingress._cuts.popleft()
            conn = conns.get(fd)
            if peer is not None and (conn is None or conn.peer == peer):  # None: not seen accepted yet
                self._drop(ingress, conns, conn or _Conn(fd, peer, 0, 0), why)
        stretch = 1 if ingress.responsive() else STALLED_FACTOR
        per_connection = stretch * ingress.limit(ingress.per_connection)
        for fd, conn in list(conns.items()):
            count = ingress.count.get(fd, 0)
            if not (sweep or fd in dirty or count != conn.seen or conn.held < 0):
                continue  # nothing arrived and nothing was delivered: its count stands
            received = _borrow(fd, _received)
            if received is None:
                self._forget(ingress, conns, conn)
                continue
            self._account(ingress, conn, received, count)
            if conn.held > per_connection and not conn.draining:
                self._drop(ingress, conns, conn, f"more than {per_connection} bytes undelivered")
        total = stretch * ingress.limit(ingress.total)
        stuck = sorted((c for c in conns.values() if not c.draining), key=lambda c: c.held)
        while stuck and sum(c.held for c in conns.values()) > total:
            self._drop(ingress, conns, stuck.pop(), f"connections together past {total} bytes")

    @staticmethod
    def _account(ingress: Ingress, conn: _Conn, received: int, count: int) -> None:
        excess = received - ingress.bytes.get(conn.fd, 0) - conn.base
        if excess < 0:  # more accounted than received: a reused descriptor's counts; start afresh
            conn.base += excess
            excess = 0
        conn.draining = count != conn.seen
        if conn.draining:  # a message was delivered: forgive what never reaches the owner
            conn.seen = count
            grant = min(excess, GRANT_BYTES)
            conn.base += grant
            excess -= grant
        conn.held = excess

    def _drop(self, ingress: Ingress, conns: dict[int, _Conn], conn: _Conn, why: str) -> None:
        self._forget(ingress, conns, conn)
        if _borrow(conn.fd, _shutdown_if(conn.peer)):
            ingress.dropped += 1
            event(log, logging.WARNING, "ingress.dropped", socket=ingress.name, peer=f"{conn.peer[0]}:{conn.peer[1]}",
                  held=conn.held, reason=why)


_instance: _Watcher | None = None
_instance_lock = threading.Lock()


def _watcher() -> _Watcher:
    global _instance
    with _instance_lock:
        if _instance is None:
            _instance = _Watcher()
            _instance.start()
        return _instance
