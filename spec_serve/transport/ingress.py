"""Bound the bytes a TCP peer can make libzmq hold before the application sees them.

libzmq hands a multipart message over only once its last frame has arrived, and checks sizes per
frame only (``MAXMSGSIZE``). A peer that sends frame after frame without ending the message makes
the receiver hold all of it, and reading frame by frame (``RCVMORE``) cannot help: nothing is
readable before the last frame. So the bound is kept below libzmq. One watcher thread per process
learns every TCP connection of a watched socket from the socket monitor, reads how many bytes libzmq
has read from it (the kernel's ``TCP_INFO`` ``tcpi_bytes_received`` less its unread queue, ``FIONREAD``),
and subtracts what the socket's owner was handed from that connection (every message names its
connection, ``ZMQ_SRCFD``).

Those undelivered bytes are of two kinds the count cannot tell apart: whole messages libzmq read ahead of a
busy owner (up to the socket's ``RCVHWM`` messages a connection), and the message a peer has not finished.
Only the second is the peer's fault, so a connection is judged on what the owner has proven: once a read the
owner began after a measure found its socket empty (``reading``, then ``emptied``), every whole message that
had arrived by that measure has been handed over (a read that began before, however late it reports, proves
nothing: libzmq reads ahead meanwhile), and what it counted still undelivered belongs to a message that is
not whole (or to libzmq's last read, not queued yet: at most a message and 8 KiB). libzmq's fair queue
proves the same when the owner keeps reading without ever finding the socket empty: it reads the connections
with a whole message in turn, one message each, and looks for connections that filled up at least every 100
reads, so a connection that delivered nothing while the owner read ``FAIR_SHARE_READS`` messages plus two
per connection had no whole message waiting either. The owner reports both through its ``BoundedReader``
(``reading``, ``delivered``, ``emptied``) and reads each watched socket every turn of its loop, until a read
finds nothing; nothing is proven while it does not read, whatever keeps it (a long handler, a thread not
scheduled on a loaded host).

Invariants, checked every ``CHECK_INTERVAL_S`` (each plus what the link carries until the check that
finds it past): a connection holds at most ``backlog`` undelivered bytes, however long its owner does
not read (the owner sizes it over what an honest peer may have there: its ``RCVHWM`` messages read
ahead, one being read, one unfinished); at most ``per_connection`` proven unfinished (sized over the
largest message an honest peer sends and 8 KiB); and the socket's connections together at most
``total`` proven unfinished (the largest are cut first). A connection cut is shut
down, and libzmq frees the partial message with it. Bytes that are never delivered (ZMTP handshakes
and heartbeats) are forgiven up to ``GRANT_BYTES`` each time the connection delivers a message. Only
TCP is watched: ``ipc://`` sockets have no byte counter (their file mode admits only the owner's user).
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
from spec_serve.transport.sockets import bind_endpoint

log = logging.getLogger("spec_serve.ingress")

CHECK_INTERVAL_S = 0.01
# Messages the owner reads, beyond two per connection, before a connection that delivered none of them is
# proven to have no whole message waiting: libzmq looks for connections that filled up (activates their
# pipes) at least every 100 reads (its inbound_poll_rate), then serves each in turn; two per connection
# covers those the monitor reports a round late.
FAIR_SHARE_READS = 128
# How long a connection past ``per_connection`` stays up while its owner tells its peer why it is cut
# (``answer_cuts``): the owner's loop turn and the answer's way out. ``backlog`` still bounds it meanwhile.
TELL_S = 1.5
# Unaccounted bytes (handshake, ZMTP heartbeats) forgiven per delivered message.
GRANT_BYTES = 64 << 10
_TCP_INFO_LEN = 136
_BYTES_RECEIVED_OFFSET = 128  # struct tcp_info.tcpi_bytes_received (Linux >= 4.1)
_EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
           | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
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


@dataclasses.dataclass(frozen=True)
class _Measure:
    """One count of a connection: the bytes libzmq read from it less those delivered and forgiven (``held``),
    what the owner had been handed from it just before (``delivered`` bytes, ``count`` messages), and the
    owner's (reads begun, messages read) just after (``progress``)."""

    held: int
    delivered: int
    count: int
    progress: tuple[int, int]

    def undelivered(self, delivered: int) -> int:
        """Of the bytes counted then, those still undelivered once the owner has delivered ``delivered``
        (read later: a message delivered in between is not counted)."""
        return self.held - (delivered - self.delivered)


@dataclasses.dataclass
class _Conn:
    fd: int
    peer: tuple[Any, ...]
    base: int  # received - delivered bytes already accounted for (forgiven)
    seen: int  # messages delivered from it at the last measure
    last: _Measure | None = None  # the latest measure (None: measured in this round)
    mark: _Measure | None = None  # the measure the owner's reads have yet to prove unfinished, or not
    unfinished: int = 0  # bytes last proven part of a message that is not whole; 0 once it delivers again
    told: float | None = None  # when its owner was asked to tell its peer why it is cut (answer_cuts)


class Ingress:
    """The bound on one socket. Its ``BoundedReader`` reports every message the owner reads
    (``delivered``) and every read that found none waiting (``emptied``); the owner calls ``close``
    before closing the socket.

    ``backlog`` (default ``per_connection``: the budget already covers all a peer may send) bounds a
    connection's undelivered bytes whatever the owner does; ``per_connection`` and ``total`` bound the
    bytes proven to belong to unfinished messages (module docstring).

    ``on_handshake_failed(address)`` (on the watcher's thread) hears of each connection whose ZMTP handshake
    failed for a protocol reason (a CURVE peer with another server key, one without CURVE at a CURVE socket
    or the reverse); the event names no connection, but libzmq reports that connection's DISCONNECTED next.

    ``answer_cuts`` (a ROUTER whose peers can be answered): a connection found past ``per_connection`` whose
    peer delivered a message before (so its identity is known) is cut only ``TELL_S`` later, and its
    identity and the reason wait in ``take_told`` for the owner to answer it meanwhile. A peer whose first
    message never ends cannot be answered: no identity is known for it.

    Give the socket's ``bind``/``connect`` endpoint here rather than to ``make_socket``: the monitor
    must be in place before the first connection, or that connection goes unwatched. If binding or
    connecting fails, the socket is closed.
    """

    def __init__(self, sock: zmq.SyncSocket, name: str, *, total: Budget, per_connection: Budget | None = None,
                 backlog: Budget | None = None, router: bool = False, bind: str | None = None,
                 connect: str | None = None, answer_cuts: bool = False,
                 on_handshake_failed: Callable[[str], None] | None = None) -> None:
        self.name = name
        self.total = total
        self.per_connection = total if per_connection is None else per_connection
        self.backlog = self.per_connection if backlog is None else backlog
        self.router = router
        self.curve = sock.getsockopt(zmq.MECHANISM) == zmq.CURVE
        self.dropped = 0  # connections shut down for holding too much
        # Written by the owner thread only, read by the watcher: fd -> delivered bytes / messages; the
        # messages read from every connection; reads begun, those that found none waiting, and the number
        # of the last of those.
        self.bytes: dict[int, int] = {}
        self.count: dict[int, int] = {}
        self.reads = 0
        self.attempts = 0
        self.empties = 0
        self.empty_attempt = 0
        self._sock = sock
        # Watcher thread only: fd -> (bytes, messages) delivered through connections on it that have ended.
        self._retired: dict[int, tuple[int, int]] = {}
        # (fd, its peer when asked, why, not before): cuts the owner asked for.
        self._cuts: collections.deque[tuple[int, tuple[Any, ...] | None, str, float]] = collections.deque()
        # Router with answer_cuts: fd -> the identity of the last message it delivered (owner writes, watcher
        # reads and forgets); (identity, reason) of connections being cut, for the owner to answer.
        self.identities: dict[int, bytes] = {}
        self.on_handshake_failed = on_handshake_failed
        self._handshake_failed = False  # watcher thread: the next DISCONNECTED is that of a failed handshake
        self._told: collections.deque[tuple[bytes, str]] | None = collections.deque() if answer_cuts else None
        self._closed = threading.Event()
        self._closed_ack = threading.Event()
        _watcher().add(self, sock.get_monitor_socket(_EVENTS))
        try:
            if bind is not None:
                bind_endpoint(sock, bind)
            if connect is not None:
                sock.connect(connect)
        except BaseException:  # as make_socket: a bad endpoint must not leak the socket
            self.close()
            sock.close(0)
            raise

    def delivered(self, frames: list[zmq.Frame]) -> None:
        """Owner thread: account one message read (a ROUTER's identity frame is not on the wire)."""
        self.reads += 1
        parts = frames[1:] if self.router else frames
        if not parts:
            return
        fd = parts[-1].get(zmq.SRCFD)
        self.bytes[fd] = self.bytes.get(fd, 0) + sum(wire_bytes(len(p), self.curve) for p in parts)
        self.count[fd] = self.count.get(fd, 0) + 1
        if self._told is not None:
            self.identities[fd] = frames[0].bytes

    def take_told(self) -> list[tuple[bytes, str]]:
        """Owner thread: (identity, reason) of each connection being cut that its owner should tell why."""
        told = []
        while self._told:
            told.append(self._told.popleft())
        return told

    def reading(self) -> None:
        """Owner thread: a read begins (before it asks libzmq)."""
        self.attempts += 1

    def emptied(self) -> None:
        """Owner thread: the read begun last found no message waiting (every whole message that had arrived
        when it began was read)."""
        self.empties += 1
        self.empty_attempt = self.attempts

    def cut(self, fd: int | None, reason: str, after: float = 0.0) -> None:
        """Shut down the connection on descriptor ``fd`` (a message's ``ZMQ_SRCFD``) at the watcher's first
        check ``after`` seconds from now, e.g. one that sent a message the owner refused, once the answer the
        owner queued for it has left (a shutdown discards what libzmq has not written); any thread. Its peer
        address is taken now, so a connection that takes the descriptor over later is spared."""
        if fd is None:
            return
        self._cuts.append((fd, _borrow(fd, socket.socket.getpeername), reason, time.monotonic() + after))
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
            fd, kind = msg["value"], msg["event"]
            if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:  # its value is an error code, not a descriptor
                ingress._handshake_failed = True
            elif kind in (zmq.EVENT_ACCEPTED, zmq.EVENT_CONNECTED):
                peer = _borrow(fd, socket.socket.getpeername)
                if peer is not None and _borrow(fd, _received) is not None:
                    # Counted from the connection's first byte: a flood that began before this event is not forgiven,
                    # and what the owner was handed from it before is its own (only an ended connection's is not).
                    delivered, count = ingress._retired.get(fd, (0, 0))
                    conns[fd] = self._owners[fd] = _Conn(fd, peer, -delivered, count)
                    self._listen(fd)  # measured in this round (no last measure)
            else:
                self._ended(ingress, conns, fd, kind)

    @staticmethod
    def _handshake_failure(ingress: Ingress, conn: _Conn | None, kind: int) -> None:
        """Tell the owner of a failed handshake, by the address of the connection that ended after it."""
        if kind == zmq.EVENT_DISCONNECTED and ingress._handshake_failed:
            ingress._handshake_failed = False
            if conn is not None and ingress.on_handshake_failed is not None:
                ingress.on_handshake_failed(str(conn.peer[0]))

    def _ended(self, ingress: Ingress, conns: dict[int, _Conn], fd: int, kind: int) -> None:
        conn = conns.get(fd)
        self._handshake_failure(ingress, conn, kind)
        if conn is not None:
            self._forget(ingress, conns, conn)

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
        ingress.identities.pop(conn.fd, None)
        if self._owners.get(conn.fd) is conn:  # not if the descriptor already serves a newer connection
            del self._owners[conn.fd]
            try:
                self._epoll.unregister(conn.fd)
            except OSError:
                pass

    def _cut_due(self, ingress: Ingress, conns: dict[int, _Conn], now: float) -> None:
        """The cuts the owner asked for whose time has come."""
        for _ in range(len(ingress._cuts)):
            fd, peer, why, when = cut = ingress._cuts.popleft()
            if when > now:
                ingress._cuts.append(cut)
                continue
            conn = conns.get(fd)
            if peer is not None and (conn is None or conn.peer == peer):  # None: not seen accepted yet
                self._drop(ingress, conns, conn or _Conn(fd, peer, 0, 0), why)

    def _check(self, ingress: Ingress, conns: dict[int, _Conn], dirty: set[int], sweep: bool) -> None:
        now = time.monotonic()
        self._cut_due(ingress, conns, now)
        per_connection, backlog = ingress.limit(ingress.per_connection), ingress.limit(ingress.backlog)
        share = FAIR_SHARE_READS + 2 * len(conns)
        for fd, conn in list(conns.items()):
            self._judge(ingress, conn, share)
            if conn.unfinished > per_connection:
                why = f"a message unfinished past {per_connection} bytes"
                if not self._telling(ingress, conn, why, now):
                    self._drop(ingress, conns, conn, why)
                    continue
            if not (sweep or fd in dirty or conn.last is None or ingress.count.get(fd, 0) != conn.seen):
                continue  # nothing arrived and nothing was delivered: its count stands
            last = self._measure(ingress, conn)
            if last is None:
                self._forget(ingress, conns, conn)
            elif last.undelivered(ingress.bytes.get(fd, 0)) > backlog:
                self._drop(ingress, conns, conn, f"more than {backlog} bytes undelivered")
        total = ingress.limit(ingress.total)
        unfinished = sorted((c for c in conns.values() if c.unfinished > 0), key=lambda c: c.unfinished)
        together = sum(c.unfinished for c in unfinished)
        while unfinished and together > total:
            conn = unfinished.pop()
            together -= conn.unfinished
            self._drop(ingress, conns, conn, f"unfinished messages together past {total} bytes")

    @staticmethod
    def _telling(ingress: Ingress, conn: _Conn, why: str, now: float) -> bool:
        """True while ``conn``'s owner tells its peer why it is cut (``answer_cuts``, its identity known):
        for ``TELL_S`` from the first time it is found past its bound; its other bounds hold meanwhile."""
        if conn.told is None:
            identity = ingress.identities.get(conn.fd)
            if ingress._told is None or identity is None:
                return False
            conn.told = now
            ingress._told.append((identity, why))
        return now - conn.told < TELL_S

    @staticmethod
    def _judge(ingress: Ingress, conn: _Conn, share: int) -> None:
        """Settle ``conn.mark`` if the owner's reads since prove what it counted undelivered part of a message
        that is not whole (module docstring), or show it may not be (the connection delivered since); then
        the latest measure is next. Otherwise it waits for more reads."""
        mark = conn.mark
        if mark is None:
            return
        emptied, reads = ingress.empty_attempt, ingress.reads  # before the connection's counts (they only grow)
        count, delivered = ingress.count.get(conn.fd, 0), ingress.bytes.get(conn.fd, 0)
        if emptied > mark.progress[0] or (count == mark.count and reads - mark.progress[1] >= share):
            conn.unfinished = max(0, mark.undelivered(delivered))
        elif count != mark.count:
            conn.unfinished = 0
        else:
            return
        conn.mark = conn.last

    @staticmethod
    def _measure(ingress: Ingress, conn: _Conn) -> _Measure | None:
        """Count what ``conn`` holds undelivered now; None if it is no TCP connection (any more). What was
        delivered is read before what was received, so a message cannot count as delivered but not received,
        and the owner's progress after, so it proves things about no byte that arrived later."""
        count, delivered = ingress.count.get(conn.fd, 0), ingress.bytes.get(conn.fd, 0)
        received = _borrow(conn.fd, _received)
        if received is None:
            return None
        progress = (ingress.attempts, ingress.reads)
        excess = received - delivered - conn.base
        if excess < 0:  # more delivered than received and not forgiven (a grant forgave bytes later delivered,
            # or an ended connection's last messages were counted to this one): start afresh
            conn.base += excess
            excess = 0
        if count != conn.seen:  # a message was delivered: forgive what never reaches the owner
            grant = min(excess, GRANT_BYTES)
            conn.base += grant
            excess -= grant
        conn.seen = count
        conn.last = _Measure(excess, delivered, count, progress)
        if conn.mark is None:
            conn.mark = conn.last
        return conn.last

    def _drop(self, ingress: Ingress, conns: dict[int, _Conn], conn: _Conn, why: str) -> None:
        self._forget(ingress, conns, conn)
        if _borrow(conn.fd, _shutdown_if(conn.peer)):
            ingress.dropped += 1
            event(log, logging.WARNING, "ingress.dropped", socket=ingress.name, peer=f"{conn.peer[0]}:{conn.peer[1]}",
                  held=conn.last.held if conn.last else 0, unfinished=conn.unfinished, reason=why)


_instance: _Watcher | None = None
_instance_lock = threading.Lock()


def _watcher() -> _Watcher:
    global _instance
    with _instance_lock:
        if _instance is None:
            _instance = _Watcher()
            _instance.start()
        return _instance
