"""Join a client's message that arrived in parts (``protocol.commands.in_parts``) before the broker
handles it.

A REQUEST or SET_VOCAB whose payload passes PART_BYTES comes as its first message, whose header names
the parts and payload bytes that follow, then PART messages of the same request id. A connection
delivers in order, so a client has at most one message in parts at a time: a new first part replaces
it. The declared bytes are reserved against what the broker may hold (``room``: --max-held-bytes, and
the client's share of it) before any more arrive, so an oversized or unaffordable message is refused at
its first part, with the error its sender acts on. Invariant: the joined payload is exactly the bytes
declared, in the parts declared; anything else is a bad request and nothing of it is kept.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from spec_serve.protocol.commands import PART_BYTES, PART_FRAMES, ClientCommand, ErrorCode, Message, ProtocolError

# A message in parts not finished this long after its first part is dropped (its sender retries).
PART_TIMEOUT_S = 60.0

# Why a client cannot have ``size`` more payload bytes held (None: it can); its sender is told to back off.
Room = Callable[[bytes, int], "str | None"]
Refuse = Callable[[bytes, bytes, ErrorCode, str], None]


@dataclasses.dataclass
class _Joining:
    first: Message
    parts: int  # declared, the first included
    size: int  # declared payload bytes
    started: float
    got: int = 0  # payload bytes so far
    seen: int = 1  # parts so far


class Parts:
    """Messages of clients still arriving in parts, by client identity (the broker loop's thread only)."""

    def __init__(self, max_bytes: int, room: Room, refuse: Refuse):
        self.max_bytes = max_bytes  # the largest payload one message may carry
        self.max_parts = max_bytes // PART_BYTES + 2 + max_bytes // (PART_BYTES * PART_FRAMES)
        self._room = room
        self._refuse = refuse
        self._joining: dict[bytes, _Joining] = {}
        self.reserved = 0  # declared bytes of every message in parts

    def reserved_by(self, identity: bytes | None) -> int:
        """Bytes reserved for ``identity``'s message in parts (everyone's for None)."""
        if identity is None:
            return self.reserved
        joining = self._joining.get(identity)
        return joining.size if joining is not None else 0

    def take(self, identity: bytes, msg: Message, now: float) -> Message | None:
        """``msg`` if it is whole; the joined message when ``msg`` is the last part of one; None while
        parts are still to come (or after refusing it)."""
        if msg.command == ClientCommand.PART.value:
            return self._more(identity, msg)
        if "parts" not in msg.header:
            return msg
        self._drop(identity)  # a new message replaces one its sender gave up on
        parts, size = msg.header.get("parts"), msg.header.get("bytes")
        if isinstance(size, int) and size > self.max_bytes:
            raise ProtocolError(f"request of {size} bytes exceeds the limit of {self.max_bytes}", msg.request_id)
        if not (isinstance(parts, int) and isinstance(size, int) and 2 <= parts <= self.max_parts and size >= 0):
            raise ProtocolError(f"a message in parts needs 'parts' (2 to {self.max_parts}) and 'bytes' in its header",
                                msg.request_id)
        why = self._room(identity, size)
        if why is not None:
            self._refuse(identity, msg.request_id, ErrorCode.UNAVAILABLE, why)
            return None
        header = {k: v for k, v in msg.header.items() if k not in ("parts", "bytes")}
        joining = _Joining(dataclasses.replace(msg, header=header, payload=[]), parts, size, now)
        self._joining[identity] = joining
        self.reserved += size
        return self._add(identity, joining, msg)

    def _more(self, identity: bytes, msg: Message) -> Message | None:
        joining = self._joining.get(identity)
        if joining is None or joining.first.request_id != msg.request_id:
            return None  # a part of a message refused, dropped or replaced: nothing to join it to
        joining.seen += 1
        return self._add(identity, joining, msg)

    def _add(self, identity: bytes, joining: _Joining, msg: Message) -> Message | None:
        joining.first.payload.extend(msg.payload)
        joining.got += sum(len(memoryview(f)) for f in msg.payload)
        if joining.got > joining.size or joining.seen > joining.parts:
            self._drop(identity)
            raise ProtocolError(f"a message in parts carried more than the {joining.size} bytes in {joining.parts} "
                                f"parts its header declared", joining.first.request_id)
        if joining.seen < joining.parts:
            return None
        self._drop(identity)
        if joining.got != joining.size:
            raise ProtocolError(f"a message in parts carried {joining.got} bytes, not the {joining.size} its "
                                f"header declared", joining.first.request_id)
        return joining.first

    def expire(self, now: float, known: Callable[[bytes], bool]) -> None:
        """Drop messages whose client the broker forgot, or whose parts stopped coming."""
        for identity, joining in list(self._joining.items()):
            if not known(identity) or now - joining.started > PART_TIMEOUT_S:
                self._drop(identity)

    def _drop(self, identity: bytes) -> None:
        joining = self._joining.pop(identity, None)
        if joining is not None:
            self.reserved -= joining.size
