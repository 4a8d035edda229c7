"""Wire protocol constants and message framing: one module owns them all.

Majordomo-style (ZeroMQ RFC 7/18), adapted so that bulk bytes never cross the
broker. Every control message has the same five leading frames::

    [tag, command, service, request_id, header, *payload]

``tag`` names the peer type and protocol version, ``command`` is one byte,
``service`` the target name (UTF-8), ``request_id`` 16 bytes (or empty),
``header`` a small JSON object (each message's fields: spec_serve.protocol.messages, listed in
docs/protocol.md), and ``payload`` the codec frames (spec_serve.protocol.wire).
A ROUTER socket prepends the peer identity to what it receives.

Replies to supervision requests go straight from the worker to the client's
data socket, ``[DATA_TAG, status, request_id, header, *payload]``; the broker
sees only a small DONE: a Python broker hop on every reply byte would cap
throughput at what one broker thread copies (BENCHMARKS.md).
"""

from __future__ import annotations

import enum
import json
import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

# Peer tags: protocol name + version; a peer speaking another version is refused.
# Clients 02: a payload travels in parts (PART_BYTES). All 03/02/02: the headers name no reply path (a
# path's fields travel under offers[name] and path[name], routing under pin and near), the demand report
# rides the client's heartbeat, wire_dtype, DONE's status an enum: a peer of the old headers is refused.
# All 04/03/03: a wire_dtype="fp8" reply quantizes contract.FP8_TENSORS only (compact's final state stays in
# the model dtype), which a peer of 03/02/02 would refuse against its contract in the middle of a run.
# Data 04: tensors travel in frames of 1 MiB (CODEC_FRAME_BYTES), more than a receiver of 03 allows a reply.
CLIENT_TAG = b"SPSC04"
WORKER_TAG = b"SPSW03"
DATA_TAG = b"SPSD04"

# The broker's default ports, and what listens on each (for errors that name the fix).
FRONTEND_PORT = 5555
BACKEND_PORT = 5556
CLIENT_PORT_HINT = f"the broker's client port, its --frontend (default {FRONTEND_PORT})"
WORKER_PORT_HINT = f"the broker's worker port, its --backend (default {BACKEND_PORT})"

# The exit status of a spec-serve process that cannot bind a port it was told to use because something else
# holds it (EADDRINUSE's number on Linux): whoever picked that port (e.g. with free_port) can tell a lost race
# from any other failure, and pick again (spec_serve.tools.launch does).
EXIT_ADDRESS_IN_USE = 98

# Frames before the payload in a control message, and in a data message.
CONTROL_FRAMES = 5
DATA_FRAMES = 4

MAX_HEADER_BYTES = 64 << 10
# Nesting a header may have: our own headers nest at most 4 deep (a STATUS page). A deeper one is
# refused at decode, before anything re-encodes it (Python's json recurses once per level).
MAX_HEADER_DEPTH = 16
# Bytes of one message beyond its payload: the control frames (a header is at most
# MAX_HEADER_BYTES) and the codec's header frame. Receivers allow this over their payload limit.
CONTROL_SLACK_BYTES = 1 << 20
REQUEST_ID_BYTES = 16
# The largest frame the tensor codec makes (spec_serve.protocol.wire.MAX_FRAME_BYTES). libzmq receives each frame
# into memory of its own from malloc: frames of 1 MiB come back in memory the allocator recycles while it is still
# in cache, where 16 MiB ones land in fresh, cold memory (page faults, and the copy out of it misses the cache);
# BENCHMARKS.md, "Frames of 1 MiB".
CODEC_FRAME_BYTES = 1 << 20
# A client message's payload is at most PART_BYTES in at most PART_FRAMES frames; a larger one goes in
# parts (``in_parts``): the first message's header says how many ("parts") and their payload bytes
# ("bytes"), and each later part is a PART of the same request id, which the broker joins. So no
# message to the broker's frontend is large, and what one connection can make libzmq hold before the
# broker sees it stays small (transport/ingress.py). That matters for frames too: libzmq keeps 64
# bytes per frame, and an empty frame is 2 bytes on the wire.
PART_BYTES = 256 << 10
PART_FRAMES = 16
# What a request can hold: at most 24 payload bytes a token (input ids, attention and loss masks of 8
# bytes each); 64 rows of 32k tokens by default (about 48 MiB), a broker's --max-request-tokens.
REQUEST_BYTES_PER_TOKEN = 24
DEFAULT_MAX_REQUEST_TOKENS = 64 * 32768
# Tensors in one reply (the contract has at most 6); bounds the frames of a reply message.
MAX_REPLY_TENSORS = 16


class ClientCommand(bytes, enum.Enum):
    """Client <-> broker commands; the value is the wire byte."""

    REQUEST = b"\x01"  # client -> broker: a supervision (or embeddings) request
    ERROR = b"\x02"  # broker -> client: a request the broker could not serve
    HEARTBEAT = b"\x03"  # both ways; the broker's carries its instance id
    DISCONNECT = b"\x04"  # client -> broker: forget me and what I queued; broker -> client: I forgot you
    STATUS = b"\x05"  # client -> broker and back: workers, services, queues
    SET_VOCAB = b"\x06"  # client -> broker: register a draft-vocab mapping
    VOCAB_OK = b"\x07"  # broker -> client: mapping stored, header names its digest
    BIND = b"\x08"  # client -> broker: take a worker for myself (requests then ``pin`` it)
    BOUND = b"\x09"  # broker -> client: binding granted or refused
    RELEASE = b"\x0a"  # client -> broker: give my bound worker back to the pool
    PART = b"\x0b"  # client -> broker: more payload of the REQUEST or SET_VOCAB with this request id


class WorkerCommand(bytes, enum.Enum):
    """Worker <-> broker commands; the value is the wire byte."""

    READY = b"\x01"  # worker -> broker: register, header carries target info
    REQUEST = b"\x02"  # broker -> worker: serve this
    DONE = b"\x03"  # worker -> broker: reply delivered (or failed), credit returned
    HEARTBEAT = b"\x04"  # both ways
    DISCONNECT = b"\x05"  # broker -> worker: unknown to me, register again
    SET_VOCAB = b"\x06"  # broker -> worker: a mapping the next requests will name
    BIND = b"\x07"  # broker -> worker: serve this client alone
    RELEASE = b"\x08"  # broker -> worker: the binding ended
    REFUSED = b"\x09"  # broker -> worker: registration refused (header: error), e.g. on the client port; it exits
    LEAVE = b"\x0a"  # worker -> broker: my engine is dead, forget me now (header: reason)


class Status(bytes, enum.Enum):
    """First frame after the tag of a data message."""

    OK = b"\x00"
    ERROR = b"\x01"


class ErrorCode(str, enum.Enum):
    """Error classes a client acts on differently."""

    BAD_REQUEST = "bad_request"  # never retried: the input is wrong
    UNKNOWN_SERVICE = "unknown_service"  # no worker has ever served this name
    TIMEOUT = "timeout"  # no worker took it before its deadline
    INTERNAL = "internal"  # the engine failed; retried
    UNAVAILABLE = "unavailable"  # e.g. no worker free to bind, or the reply could not be delivered
    TARGET_CHANGED = "target_changed"  # never retried: the service serves another target than the client set up with
    KILLED_WORKERS = "killed_workers"  # workers died while serving it, too often: never retried
    ENGINE_DEAD = "engine_dead"  # the engine died serving it; never retried (it may be what killed it)
    WRONG_PORT = "wrong_port"  # a client reached the workers' port, or a worker the clients' port


class DoneStatus(str, enum.Enum):
    """DONE's ``status``: how a request's slot on a worker came free."""

    OK = "ok"  # its reply left
    ERROR = "error"  # an error reply left
    ENGINE_DEAD = "engine_dead"  # an error reply left and the engine is dead: send this worker nothing more
    UNDELIVERABLE = "undeliverable"  # the reply could not leave (its data socket takes nothing, a bad endpoint)
    RETURNED = "returned"  # a draining worker hands the request back unrun


class Op(str, enum.Enum):
    """What a REQUEST asks a worker for."""

    GENERATE = "generate"
    EMBEDDINGS = "embeddings"  # header["which"] in {"input", "output"}
    LM_HEAD_SLICE = "lm_head_slice"  # draft-vocab rows of the lm_head, for compact mode


class ReplyFormat(str, enum.Enum):
    """How a worker may shape a GENERATE reply (a REQUEST's ``format``)."""

    # EAGLE-3: the worker picks, per reply, from the path that carries it: full when the reply stays on its
    # host (``WorkerSide.local``), compact otherwise (paths/registry.py).
    AUTO = "auto"


class WireDtype(str, enum.Enum):
    """How a GENERATE reply's hidden states travel (a REQUEST's and a DATA header's ``wire_dtype``; absent:
    in the model's dtype)."""

    # float8_e4m3fn with a float32 scale per token and captured layer (supervision/fp8.py); the client
    # restores the model dtype. Opt-in: RemoteTargetModel(wire_dtype="fp8").
    FP8 = "fp8"


class ProtocolError(ValueError):
    """A message that does not follow this protocol; ``request_id`` when the frames named one."""

    def __init__(self, message: str, request_id: bytes = b""):
        super().__init__(message)
        self.request_id = request_id


class TypedHeader(Protocol):
    """A typed header (spec_serve.protocol.messages): ``to_json()`` is what the header frame carries."""

    def to_json(self) -> dict[str, Any]: ...


def new_request_id() -> bytes:
    return uuid.uuid4().bytes


def encode_header(header: Mapping[str, Any] | TypedHeader) -> bytes:
    fields = header if isinstance(header, Mapping) else header.to_json()
    return json.dumps(fields, separators=(",", ":")).encode()


def decode_header(raw: bytes | memoryview) -> dict[str, Any]:
    """A JSON object of at most ``MAX_HEADER_BYTES``, nested at most ``MAX_HEADER_DEPTH`` deep."""
    raw = bytes(raw)
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    if not raw:
        return {}
    try:
        header = json.loads(raw)
    except RecursionError:
        raise ProtocolError(f"header nests deeper than {MAX_HEADER_DEPTH} levels") from None
    except ValueError as e:  # JSONDecodeError, bad UTF-8, an integer of more than 4300 digits
        raise ProtocolError(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header must be a JSON object")
    if _depth(header) > MAX_HEADER_DEPTH:
        raise ProtocolError(f"header nests deeper than {MAX_HEADER_DEPTH} levels")
    return header


def _depth(value: Any) -> int:
    """Nesting depth of a decoded JSON value (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if level <= MAX_HEADER_DEPTH:  # deeper is refused anyway: stop walking
            stack.extend((child, level + 1) for child in children)
    return deepest


@dataclass
class Message:
    """A parsed control message (without the ROUTER identity)."""

    command: bytes
    service: str
    request_id: bytes
    header: dict[str, Any]
    payload: list[Any]  # codec frames, zero-copy


def control(tag: bytes, command: bytes, service: str = "", request_id: bytes = b"",
            header: Mapping[str, Any] | TypedHeader | None = None, payload: Sequence[Any] = ()) -> list[Any]:
    """Frames of one control message."""
    return [tag, command, service.encode(), request_id, encode_header(header if header is not None else {}),
            *payload]


# Commands whose messages carry a payload; every other control message has exactly CONTROL_FRAMES frames.
_PAYLOAD_COMMANDS = {
    CLIENT_TAG: (ClientCommand.REQUEST.value, ClientCommand.SET_VOCAB.value, ClientCommand.PART.value),
    WORKER_TAG: (WorkerCommand.REQUEST.value, WorkerCommand.SET_VOCAB.value),
}


def frame_limit(head: Sequence[Any], payload_frames: int) -> int:
    """The most frames a control message starting with ``head`` (its tag and command frames, or fewer)
    may have: CONTROL_FRAMES, and ``payload_frames`` more for a command that carries a payload. A
    receiver refuses a longer message before reading the rest (transport/bounded.py)."""
    tag, command = (_bytes(f) for f in head[:2]) if len(head) >= 2 else (b"", b"")
    return CONTROL_FRAMES + (payload_frames if command in _PAYLOAD_COMMANDS.get(tag, ()) else 0)


def reply_frame_limit(max_reply_bytes: int) -> int:
    """The most frames a data message (a reply) of at most ``max_reply_bytes`` payload may have: the codec's
    header frame, and each tensor's bytes in frames of at most wire.MAX_FRAME_BYTES."""
    return DATA_FRAMES + 1 + MAX_REPLY_TENSORS + max_reply_bytes // CODEC_FRAME_BYTES


def request_bytes(tokens: int) -> int:
    """The largest request payload of ``tokens`` tokens (the codec's header included)."""
    return tokens * REQUEST_BYTES_PER_TOKEN + MAX_HEADER_BYTES


def in_parts(frames: Sequence[Any]) -> list[list[Any]]:
    """A client's control message as the messages it is sent in: itself, or, when its payload passes
    PART_BYTES or PART_FRAMES, the message with the first part of the payload and a header naming the
    parts, then one PART message per further part. Zero-copy: parts are views of the payload's frames."""
    head, payload = list(frames[:CONTROL_FRAMES]), [memoryview(f).cast("B") for f in frames[CONTROL_FRAMES:]]
    total = sum(len(f) for f in payload)
    if total <= PART_BYTES and len(payload) <= PART_FRAMES:
        return [list(frames)]
    parts: list[list[Any]] = [[]]
    room = PART_BYTES
    for frame in payload:
        while len(frame):
            if room == 0 or len(parts[-1]) == PART_FRAMES:
                parts.append([])
                room = PART_BYTES
            piece, frame = frame[:room], frame[room:]
            parts[-1].append(piece)
            room -= len(piece)
    header = decode_header(head[4])
    header.update(parts=len(parts), bytes=total)
    tag, _, service, request_id = head[:4]
    first = [*head[:4], encode_header(header), *parts[0]]
    return [first, *([tag, ClientCommand.PART.value, service, request_id, b"", *part] for part in parts[1:])]


def parse_control(frames: Sequence[Any], tag: bytes, commands: type[enum.Enum]) -> Message:
    """Parse a control message, checking tag, command, and frame sizes."""
    if len(frames) < CONTROL_FRAMES:
        raise ProtocolError(f"message has {len(frames)} frames, expected at least {CONTROL_FRAMES}")
    got_tag, command, service, request_id, header = (_bytes(f) for f in frames[:CONTROL_FRAMES])
    if got_tag != tag:
        raise ProtocolError(f"protocol tag {got_tag[:16]!r} is not {tag!r} (wrong peer type or version)")
    try:
        command = commands(command).value
    except ValueError:
        raise ProtocolError(f"unknown command {command[:4]!r}") from None
    if len(service) > 256:
        raise ProtocolError("service name longer than 256 bytes")
    try:
        service_name = service.decode()
    except UnicodeDecodeError:
        raise ProtocolError("service name is not UTF-8") from None
    if request_id and len(request_id) != REQUEST_ID_BYTES:
        raise ProtocolError(f"request id must be {REQUEST_ID_BYTES} bytes, got {len(request_id)}")
    try:
        decoded = decode_header(header)
    except ProtocolError as e:  # the sender can match the error to its request
        raise ProtocolError(str(e), request_id) from None
    return Message(command, service_name, request_id, decoded, list(frames[CONTROL_FRAMES:]))


def data_message(status: Status, request_id: bytes, header: Mapping[str, Any] | TypedHeader,
                 payload: Sequence[Any] = ()) -> list[Any]:
    return [DATA_TAG, status.value, request_id, encode_header(header), *payload]


def parse_data(frames: Sequence[Any]) -> tuple[Status, bytes, dict[str, Any], list[Any]]:
    """Parse a worker -> client data message."""
    if len(frames) < DATA_FRAMES:
        raise ProtocolError(f"data message has {len(frames)} frames, expected at least {DATA_FRAMES}")
    tag, status, request_id, header = (_bytes(f) for f in frames[:DATA_FRAMES])
    if tag != DATA_TAG:
        raise ProtocolError(f"data tag {tag[:16]!r} is not {DATA_TAG!r}")
    try:
        status = Status(status)
    except ValueError:
        raise ProtocolError(f"unknown data status {status[:4]!r}") from None
    if len(request_id) != REQUEST_ID_BYTES:
        raise ProtocolError("data message without a valid request id")
    return status, request_id, decode_header(header), list(frames[DATA_FRAMES:])


def _bytes(frame: Any) -> bytes:
    # zmq.Frame exposes .bytes; plain bytes/memoryview pass through.
    return frame.bytes if hasattr(frame, "bytes") else bytes(frame)


def env_float(name: str, default: float) -> float:
    """A float tunable from the environment (used by tests to shorten timers)."""
    value = os.environ.get(name)
    return float(value) if value else default


# Heartbeats: every peer sends one each interval and is dead after LIVENESS
# silent intervals. A long forward does not block them (they run on I/O threads).
HEARTBEAT_INTERVAL = env_float("SPEC_SERVE_HEARTBEAT_INTERVAL", 1.0)
HEARTBEAT_LIVENESS = int(env_float("SPEC_SERVE_HEARTBEAT_LIVENESS", 4))
# How long a request for a service no worker has ever registered waits before
# the broker answers UNKNOWN_SERVICE: long enough for workers starting up.
UNKNOWN_SERVICE_GRACE = env_float("SPEC_SERVE_UNKNOWN_SERVICE_GRACE", 10.0)
# How long a client waits for any answer from a broker it has never heard from before it fails
# its requests with the address and the likely cause (RemoteTargetModel(connect_timeout=...)).
CONNECT_TIMEOUT = env_float("SPEC_SERVE_CONNECT_TIMEOUT", 30.0)
