"""Read a multipart message frame by frame, and refuse one with more frames than its kind may have.

libzmq hands the application a multipart message only once it has arrived whole (the ingress watcher,
transport/ingress.py, bounds the bytes that can pile up before that), but then the frames can be read
one at a time. ``recv_multipart`` would build a Python object per frame of whatever arrived: a message
of a million empty frames (2 MB on the wire) costs seconds and hundreds of MiB. A ``BoundedReader``
reads the first frames, asks the owner's ``limit`` how many frames a message starting so may have,
reads up to that many, and refuses the message if more follow: it returns an ``Overlong`` with the frames
read, and discards the rest without building objects (``recv_into`` a small scratch buffer), at most
``DISCARD_SLICE`` frames per call, so the owner's loop keeps serving its other sockets and timers while
a refused message is discarded. Invariant: a socket's owner never holds more than ``limit`` frames of
one message, and never spends more than ``DISCARD_SLICE`` frame reads in one call.

A watched socket's reader tells its ``Ingress`` of every message it reads and of every read that found
none waiting, so the ingress watcher learns both from the one place the owner reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

if TYPE_CHECKING:
    from spec_serve.transport.ingress import Ingress

# Frames discarded per call while a refused message is drained (a few ms).
DISCARD_SLICE = 20_000
# Frames read (after a ROUTER's identity) before the limit is asked: the tag and the command.
HEAD_FRAMES = 2


@dataclasses.dataclass
class Overlong:
    """A message with more frames than ``limit``: the first ``limit`` frames (a ROUTER's identity first)."""

    frames: list[Any]
    limit: int

    @property
    def source_fd(self) -> int | None:
        """The descriptor of the connection it came from (``ZMQ_SRCFD`` of its last frame read)."""
        try:
            fd: int = self.frames[-1].get(zmq.SRCFD)
            return fd
        except (zmq.ZMQError, AttributeError):
            return None


class BoundedReader:
    """Reads ``sock``'s messages (owner thread only). ``limit(head)`` gets the first frames of a message
    (after a ROUTER's identity; up to its tag and command) and returns the most frames it may have, the
    identity not counted. ``ingress``: the socket's watcher, told of each read (``Ingress.delivered``,
    ``Ingress.reading``, ``Ingress.emptied``)."""

    def __init__(self, sock: zmq.SyncSocket, limit: Callable[[list[Any]], int], *, router: bool = False,
                 ingress: Ingress | None = None):
        self.sock = sock
        self.limit = limit
        self.ingress = ingress
        self.skip = 1 if router else 0  # the identity frame: not on the wire, not counted
        self.discarded = 0  # frames of refused messages thrown away, ever
        self._discarding = False
        self._scratch = bytearray(64)
        self._discard_one = getattr(sock, "recv_into", None)  # pyzmq >= 26.4; else a frame object each

    def read(self) -> list[Any] | Overlong | None:
        """The next message (``copy=False`` frames), an ``Overlong`` one, or None: nothing to read now, or a
        refused message still being discarded (call again when the socket polls readable)."""
        if self._discarding and not self._discard(DISCARD_SLICE):
            return None
        if self.ingress is not None:
            self.ingress.reading()
        try:
            frame = self.sock.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            if self.ingress is not None:
                self.ingress.emptied()
            return None
        frames = [frame]
        # Later frames of a message are there at once: libzmq delivers only whole messages.
        while frames[-1].more and len(frames) < self.skip + HEAD_FRAMES:
            frames.append(self.sock.recv(zmq.NOBLOCK, copy=False))
        limit = self.limit(frames[self.skip:])
        while frames[-1].more and len(frames) < self.skip + limit:
            frames.append(self.sock.recv(zmq.NOBLOCK, copy=False))
        if self.ingress is not None:
            self.ingress.delivered(frames)
        if not frames[-1].more:
            return frames
        self._discarding = True
        self._discard(DISCARD_SLICE)
        return Overlong(frames, limit)

    @property
    def discarding(self) -> bool:
        """A refused message's frames are still being thrown away."""
        return self._discarding

    def _discard(self, budget: int) -> bool:
        """Throw away up to ``budget`` frames of the refused message; True once its last one is gone."""
        for _ in range(budget):
            if self._discard_one is not None:
                self._discard_one(self._scratch, flags=zmq.NOBLOCK)
            else:
                self.sock.recv(zmq.NOBLOCK, copy=False)
            self.discarded += 1
            if not self.sock.getsockopt(zmq.RCVMORE):
                self._discarding = False
                return True
        return False
