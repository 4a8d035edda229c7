"""Typed message headers: one frozen dataclass per message, documented in docs/protocol.md.

The JSON header frame of a control or data message (spec_serve.protocol.commands) is built with
``to_json()`` and read with ``from_json()``:

- ``to_json()`` gives the dict senders have always sent: keys in field order, a field left out while it
  holds its "absent" value (None, or False for a flag) unless it is ``always`` sent, and a field renamed
  where its JSON key is a Python builtin (``key``).
- ``from_json()`` checks a received header once: required keys, JSON types, bounds. A bad header raises
  ``ProtocolError`` (a ``ValueError``) naming the message and the key. Keys a message does not define
  are ignored. Values keep their JSON type (an int ``timeout`` stays an int), so re-encoding a received
  message gives the same bytes.

What a field's value means beyond its type (a vocab digest names a registered mapping, a path's offer or
descriptor names a live slot) is checked where it is used. The reply paths' own fields travel opaquely, as
JSON objects under ``offers[name]`` (a request) and ``path[name]`` (a reply): each path types and checks its
own (spec_serve/paths/), so this module names none of them.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from spec_serve.protocol.commands import DoneStatus, Op, ProtocolError, ReplyFormat, WireDtype

if TYPE_CHECKING:
    from typing_extensions import Self

Json = dict[str, Any]
T = TypeVar("T")

# A request's timeout when its header names none (seconds), and the largest one accepted.
DEFAULT_REQUEST_TIMEOUT = 120
_FORMATS = {f.value for f in ReplyFormat}
_DONE_STATUSES = {s.value for s in DoneStatus}
_WIRE_DTYPES = {d.value for d in WireDtype}
DEFAULT_KIND = "eagle3"  # supervision.contract.Kind.EAGLE3: what a REQUEST naming no kind asks for
MAX_REQUEST_TIMEOUT = 1e7
MAX_FINGERPRINT_CHARS = 128
MAX_ENDPOINT_CHARS = 512
MAX_HOST_KEY_CHARS = 256  # sockets.local_host_key: a boot id and three namespace inodes
_SHOWN_CHARS = 80  # of a bad value, in an error


# Field metadata: ``always``, sent even as null/false; ``key``, its JSON key where that differs from its name.
ALWAYS: Mapping[str, Any] = {"always": True}


def json_key(field: dataclasses.Field[Any]) -> str:
    """The field's key in the JSON header."""
    return str(field.metadata.get("key") or field.name)


def _default(value: T | None, default: T) -> T:
    return default if value is None else value


@dataclasses.dataclass(frozen=True)
class WireMessage:
    """Base of every typed header. ``COMMAND`` names the message in errors and in docs/protocol.md."""

    COMMAND: ClassVar[str] = ""

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Self:
        raise NotImplementedError

    def to_json(self) -> Json:
        out: Json = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if (value is None or value is False) and not field.metadata.get("always"):
                continue  # absent: not on the wire
            out[json_key(field)] = (value.to_json() if isinstance(value, WireMessage)
                                    else value.value if isinstance(value, enum.Enum) else value)
        return out


class HeaderReader:
    """One received header, read key by key; each accessor checks its key or raises ProtocolError."""

    _ABSENT = object()

    def __init__(self, command: str, raw: Mapping[str, Any]):
        if not isinstance(raw, Mapping):
            raise ProtocolError(f"{command} header must be a JSON object")
        self.command, self.raw = command, raw

    def _take(self, key: str, ok: Callable[[Any], bool], expected: str, error: str | None,
              required: bool, nullable: bool) -> Any:
        value = self.raw.get(key, self._ABSENT)
        if value is self._ABSENT or (nullable and value is None):
            if required:
                raise ProtocolError(error or f"{self.command} header needs '{key}', {expected}")
            return None
        if not ok(value):
            raise ProtocolError(error or f"{self.command} header '{key}' must be {expected}, "
                                         f"got {repr(value)[:_SHOWN_CHARS]}")
        return value

    def text(self, key: str, *, max_chars: int | None = None, nullable: bool = False,
             error: str | None = None, ok: Callable[[str], bool] | None = None) -> str | None:
        """A string, or None when absent (or null, if ``nullable``); ``ok`` may restrict its values."""
        check = ok

        def ok_text(v: Any) -> bool:
            return isinstance(v, str) and (max_chars is None or len(v) <= max_chars) and (check is None or check(v))

        expected = "a string" if max_chars is None else f"a string of at most {max_chars} characters"
        result: str | None = self._take(key, ok_text, expected, error, False, nullable)
        return result

    def required_text(self, key: str, *, ok: Callable[[str], bool] | None = None, error: str | None = None) -> str:
        result: str = self._take(key, lambda v: isinstance(v, str) and (ok is None or ok(v)), "a string", error,
                                 True, False)
        return result

    def integer(self, key: str, *, minimum: int | None = None, error: str | None = None) -> int | None:
        expected = "an integer" if minimum is None else f"an integer >= {minimum}"
        result: int | None = self._take(key, lambda v: _is_int(v) and (minimum is None or v >= minimum),
                                        expected, error, False, False)
        return result

    def required_integer(self, key: str, *, minimum: int | None = None) -> int:
        expected = "an integer" if minimum is None else f"an integer >= {minimum}"
        result: int = self._take(key, lambda v: _is_int(v) and (minimum is None or v >= minimum), expected, None,
                                 True, False)
        return result

    def number(self, key: str, *, positive: bool = False, minimum: float = -math.inf, below: float = math.inf,
               required: bool = False, expected: str = "a number") -> float | None:
        """An int or float as sent (not converted, so it re-encodes to the same bytes)."""
        def ok(v: Any) -> bool:
            return _is_number(v) and (not positive or v > 0) and minimum <= v < below

        result: float | None = self._take(key, ok, expected, None, required, False)
        return result

    def flag(self, key: str) -> bool:
        return bool(self._take(key, lambda v: isinstance(v, bool), "true or false", None, False, True))

    def texts(self, key: str, *, max_items: int | None = None, error: str | None = None) -> list[str] | None:
        def ok(v: Any) -> bool:
            return (isinstance(v, list) and all(isinstance(s, str) for s in v)
                    and (max_items is None or len(v) <= max_items))

        result: list[str] | None = self._take(key, ok, "a list of strings", error, False, False)
        return result

    def obj(self, key: str, *, required: bool = False, error: str | None = None) -> Json | None:
        result: Json | None = self._take(key, lambda v: isinstance(v, dict), "a JSON object", error, required,
                                         False)
        return result

    def array(self, key: str, *, nullable: bool = False) -> list[Any] | None:
        result: list[Any] | None = self._take(key, lambda v: isinstance(v, list), "a list", None, False, nullable)
        return result


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def valid_endpoint(endpoint: Any) -> bool:
    """A ``reply_to`` a worker may connect to: ``tcp://host:port`` or ``ipc://path``."""
    if not isinstance(endpoint, str) or len(endpoint) > MAX_ENDPOINT_CHARS:
        return False
    if endpoint.startswith("ipc://"):
        return len(endpoint) > 6 and "\x00" not in endpoint
    if not endpoint.startswith("tcp://"):
        return False
    host, _, port = endpoint[6:].rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536 and "*" not in host


# ------------------------------------------------------------- client -> broker -> worker


@dataclasses.dataclass(frozen=True)
class SupervisionRequest(WireMessage):
    """REQUEST: client -> broker, forwarded to a worker with ``client`` added. The broker checks the
    routing fields; what a worker computes (``op``, ``which``, ``kind``) it checks when it serves."""

    COMMAND: ClassVar[str] = "REQUEST"

    # In the order senders have always used: what the caller asks, then what every request carries.
    op: str | None = None
    which: str | None = None
    kind: str | None = None
    format: str | None = None
    wire_dtype: str | None = None  # a WireDtype: how the reply's hidden states travel (absent: model dtype)
    timeout: float = DEFAULT_REQUEST_TIMEOUT
    tokens: int | None = None
    pin: str | None = None  # the one worker (by name) that may take it: one the client holds (BIND)
    near: str | None = None  # a host key: a worker of that host is preferred (the reply stays on the client's host)
    offers: Json | None = None  # {path name: its offer}: how a worker may send the reply (spec_serve/paths/)
    reply_to: str = ""
    max_reply_bytes: int | None = None
    fingerprint: str | None = None
    vocab: str | None = None
    data_key: str | None = None
    verify: bool = False
    avoid: str | None = None
    client: str | None = None

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> SupervisionRequest:
        r = HeaderReader(cls.COMMAND, raw)
        return cls(
            reply_to=r.required_text("reply_to", ok=valid_endpoint, error=(
                "REQUEST header needs reply_to, a tcp://host:port or ipc:// endpoint")),
            op=r.text("op"), which=r.text("which"), kind=r.text("kind"),
            format=r.text("format", ok=lambda v: v in _FORMATS, error=(
                f"REQUEST header 'format' must be one of {sorted(_FORMATS)}")),
            wire_dtype=_wire_dtype(r),
            timeout=_timeout(r),
            tokens=r.integer("tokens", minimum=0),
            pin=r.text("pin", nullable=True, error="REQUEST header 'pin' must be a worker name string"),
            near=r.text("near", max_chars=MAX_HOST_KEY_CHARS, error=(
                f"REQUEST header 'near' must be a host key of at most {MAX_HOST_KEY_CHARS} characters")),
            offers=r.obj("offers"),
            max_reply_bytes=r.integer("max_reply_bytes"),
            fingerprint=_fingerprint(r),
            vocab=r.text("vocab", error="REQUEST header 'vocab' must be a digest string"),
            data_key=r.text("data_key", error="REQUEST header 'data_key' must be a Z85 string"),
            verify=r.flag("verify"),
            avoid=r.text("avoid", error="REQUEST header 'avoid' must be a worker id string"),
            client=r.text("client"),
        )

    @property
    def operation(self) -> str:
        """``op``; a request that names none asks to generate."""
        return Op.GENERATE.value if self.op is None else self.op

    @property
    def is_generate(self) -> bool:
        return self.operation == Op.GENERATE.value

    @property
    def supervision_kind(self) -> str:
        """``kind``; EAGLE-3 when the request names none."""
        return DEFAULT_KIND if self.kind is None else self.kind

    def offer(self, path: str) -> Any:
        """What the request offers the reply path named ``path`` (a peer's JSON, for the path to check); None."""
        return (self.offers or {}).get(path)

    def without_offer(self, path: str, *, unpin: bool = False) -> SupervisionRequest:
        """The request without ``path``'s offer (and, with ``unpin``, free to go to any worker of the pool)."""
        offers = {name: offer for name, offer in (self.offers or {}).items() if name != path}
        return dataclasses.replace(self, offers=offers or None, pin=None if unpin else self.pin)


def _wire_dtype(r: HeaderReader) -> str | None:
    return r.text("wire_dtype", ok=lambda v: v in _WIRE_DTYPES,
                  error=f"{r.command} header 'wire_dtype' must be one of {sorted(_WIRE_DTYPES)}")


def _timeout(r: HeaderReader) -> float:
    timeout = r.number("timeout", positive=True, below=MAX_REQUEST_TIMEOUT, expected="a positive number of seconds")
    return _default(timeout, DEFAULT_REQUEST_TIMEOUT)


def _fingerprint(r: HeaderReader) -> str | None:
    return r.text("fingerprint", max_chars=MAX_FINGERPRINT_CHARS, nullable=True,
                  error=f"{r.command} header 'fingerprint' must be a target fingerprint string")


# ------------------------------------------------------------------ client <-> broker


@dataclasses.dataclass(frozen=True)
class BrokerHeartbeat(WireMessage):
    """HEARTBEAT, broker -> client: ``broker`` is its instance id (a new one: it restarted); ``stopping``:
    the broker's last word, it was told to stop (what it queued is gone; a successor gets it again)."""

    COMMAND: ClassVar[str] = "HEARTBEAT"

    broker: str | None = None
    stopping: bool = False

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> BrokerHeartbeat:
        r = HeaderReader(cls.COMMAND, raw)
        return cls(broker=r.text("broker"), stopping=r.flag("stopping"))


@dataclasses.dataclass(frozen=True)
class ClientHeartbeat(WireMessage):
    """HEARTBEAT, client -> broker: with a rank's demand, for the service its control frame names (docs/sizing.md).
    ``wait_s``: seconds it was blocked waiting for supervision; ``compute_s``: seconds between its requests
    otherwise (its own compute); ``steps``: batches it asked for. Cumulative since the client started, counted
    up to the moment of sending (a step in progress included). An older client's empty header reports nothing."""

    COMMAND: ClassVar[str] = "HEARTBEAT (client)"

    steps: int | None = None
    wait_s: float | None = None
    compute_s: float | None = None

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> ClientHeartbeat:
        r = HeaderReader(cls.COMMAND, raw)
        seconds = "a number of seconds >= 0"
        return cls(steps=r.integer("steps", minimum=0), wait_s=r.number("wait_s", minimum=0, expected=seconds),
                   compute_s=r.number("compute_s", minimum=0, expected=seconds))


@dataclasses.dataclass(frozen=True)
class SetVocab(WireMessage):
    """SET_VOCAB, client -> broker: register the mapping in the payload; drop the ``release`` ones."""

    COMMAND: ClassVar[str] = "SET_VOCAB"
    MAX_RELEASE: ClassVar[int] = 257  # the broker's MAX_REQUESTS_PER_CLIENT + 1

    fingerprint: str | None = None
    release: list[str] | None = None

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> SetVocab:
        r = HeaderReader(cls.COMMAND, raw)
        return cls(fingerprint=_fingerprint(r), release=r.texts(
            "release", max_items=cls.MAX_RELEASE, error="SET_VOCAB 'release' must be a list of mapping digests"))


@dataclasses.dataclass(frozen=True)
class VocabOk(WireMessage):
    """VOCAB_OK, broker -> client: the registered mapping's digest."""

    COMMAND: ClassVar[str] = "VOCAB_OK"

    digest: str = ""

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> VocabOk:
        return cls(digest=HeaderReader(cls.COMMAND, raw).required_text("digest"))


@dataclasses.dataclass(frozen=True)
class BrokerError(WireMessage):
    """ERROR, broker -> client (and a client on the workers' port): ``code`` is an ErrorCode value.
    ``unknown_vocab``: the broker lacks the request's mapping; ``unpinned``: the worker it was pinned to cannot
    take it, re-send it to the pool."""

    COMMAND: ClassVar[str] = "ERROR"

    code: str = ""
    error: str = ""
    unknown_vocab: bool = False
    unpinned: bool = False

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> BrokerError:
        r = HeaderReader(cls.COMMAND, raw)
        return cls(code=r.required_text("code"), error=r.required_text("error"),
                   unknown_vocab=r.flag("unknown_vocab"), unpinned=r.flag("unpinned"))


@dataclasses.dataclass(frozen=True)
class StatusQuery(WireMessage):
    """STATUS, client -> broker: one page of the broker's view, of ``service`` only if named, after
    the cursor ``after`` (the ``next`` of the page before)."""

    COMMAND: ClassVar[str] = "STATUS"

    service: str | None = None
    after: list[Any] | None = None

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> StatusQuery:
        r = HeaderReader(cls.COMMAND, raw)
        service = r.text("service", nullable=True, error="STATUS 'service' must be a service name")
        after = r.array("after", nullable=True)
        if after is not None and not _is_cursor(after):
            raise ProtocolError("STATUS 'after' must be the 'next' cursor of an earlier page")
        return cls(service=service, after=after)


def _is_cursor(after: Any) -> bool:
    """A STATUS page cursor: ``[0, service]`` or ``[1, service, worker id]``."""
    return isinstance(after, list) and (
        (len(after) == 2 and after[0] == 0 and isinstance(after[1], str))
        or (len(after) == 3 and after[0] == 1 and all(isinstance(k, str) for k in after[1:])))


@dataclasses.dataclass(frozen=True)
class StatusPage(WireMessage):
    """STATUS, broker -> client: the broker's summary, then as many service and worker entries as fit a
    page; ``next`` is the cursor of the next page (null on the last)."""

    COMMAND: ClassVar[str] = "STATUS page"

    broker: str = ""
    uptime_s: float = 0.0
    unknown_service_grace_s: float = 0.0
    clients: int = 0
    inflight: int = 0
    queued: int = 0
    service_count: int = 0
    worker_count: int = 0
    max_message_bytes: int = 0
    services: dict[str, Json] = dataclasses.field(default_factory=dict)
    workers: list[Json] = dataclasses.field(default_factory=list)
    next: list[Any] | None = dataclasses.field(default=None, metadata=ALWAYS)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> StatusPage:
        r = HeaderReader(cls.COMMAND, raw)
        services = _default(r.obj("services", required=True), {})
        workers = _default(r.array("workers"), [])
        if not all(isinstance(s, dict) for s in services.values()) or not all(isinstance(w, dict) for w in workers):
            raise ProtocolError("STATUS page 'services' and 'workers' entries must be JSON objects")
        count = r.required_integer
        return cls(
            broker=r.required_text("broker"),
            uptime_s=_default(r.number("uptime_s", required=True), 0.0),
            unknown_service_grace_s=_default(r.number("unknown_service_grace_s", required=True), 0.0),
            clients=count("clients", minimum=0), inflight=count("inflight", minimum=0),
            queued=count("queued", minimum=0), service_count=count("service_count", minimum=0),
            worker_count=count("worker_count", minimum=0), max_message_bytes=count("max_message_bytes", minimum=0),
            services=services, workers=workers, next=r.array("next", nullable=True),
        )


@dataclasses.dataclass(frozen=True)
class BindRequest(WireMessage):
    """BIND, client -> broker: a worker of my own, for a reply path that needs one."""

    COMMAND: ClassVar[str] = "BIND"

    reply_to: str = ""
    timeout: float = DEFAULT_REQUEST_TIMEOUT
    device_type: str | None = dataclasses.field(default=None, metadata=ALWAYS)
    data_key: str | None = None

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> BindRequest:
        r = HeaderReader(cls.COMMAND, raw)
        strings = "BIND header data_key and device_type must be strings"
        return cls(reply_to=r.required_text("reply_to", ok=valid_endpoint, error=(
            "BIND header needs reply_to, a tcp://host:port or ipc:// endpoint")),
            timeout=_timeout(r), device_type=r.text("device_type", nullable=True, error=strings),
            data_key=r.text("data_key", nullable=True, error=strings))


@dataclasses.dataclass(frozen=True)
class Bound(WireMessage):
    """BOUND, broker -> client: a BIND refused (``code``), or a bound worker ``lost`` (its binding ``prefix``)."""

    COMMAND: ClassVar[str] = "BOUND"

    ok: bool = dataclasses.field(default=False, metadata=ALWAYS)
    code: str | None = None
    lost: str | None = None
    prefix: str | None = None
    error: str = "no reason given"

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Bound:
        r = HeaderReader(cls.COMMAND, raw)
        return cls(ok=r.flag("ok"), code=r.text("code"), lost=r.text("lost"), prefix=r.text("prefix"),
                   error=r.text("error") or "no reason given")


@dataclasses.dataclass(frozen=True)
class Release(WireMessage):
    """RELEASE, client -> broker and broker -> worker: the binding ``prefix`` ended (client: null = all mine)."""

    COMMAND: ClassVar[str] = "RELEASE"

    prefix: str | None = dataclasses.field(default=None, metadata=ALWAYS)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Release:
        return cls(prefix=HeaderReader(cls.COMMAND, raw).text("prefix", nullable=True))


# ------------------------------------------------------------------ broker <-> worker


@dataclasses.dataclass(frozen=True)
class Ready(WireMessage):
    """READY, worker -> broker: register (again). ``max_message_bytes`` that is not a positive int is ignored."""

    COMMAND: ClassVar[str] = "READY"

    target_info: Json = dataclasses.field(default_factory=dict)
    capacity: int = 1
    pid: int | None = None
    host: str | None = None
    host_key: str | None = None  # sockets.local_host_key: requests ``near`` it prefer this worker
    max_message_bytes: int | None = None

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Ready:
        r = HeaderReader(cls.COMMAND, raw)
        bad = "READY needs target_info and a positive capacity"
        limit = raw.get("max_message_bytes")
        return cls(target_info=_default(r.obj("target_info", required=True, error=bad), {}),
                   capacity=_default(r.integer("capacity", minimum=1, error=bad), 1),
                   pid=r.integer("pid"), host=r.text("host"),
                   host_key=r.text("host_key", max_chars=MAX_HOST_KEY_CHARS),
                   max_message_bytes=limit if isinstance(limit, int) and _is_int(limit) and limit > 0 else None)


@dataclasses.dataclass(frozen=True)
class Refused(WireMessage):
    """REFUSED, broker -> worker: registration refused (the worker exits); ``code`` wrong_port on the clients' port."""

    COMMAND: ClassVar[str] = "REFUSED"

    code: str | None = None
    error: str = "no reason given"

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Refused:
        r = HeaderReader(cls.COMMAND, raw)
        return cls(code=r.text("code"), error=r.text("error") or "no reason given")


@dataclasses.dataclass(frozen=True)
class WorkerSetVocab(WireMessage):
    """SET_VOCAB, broker -> worker: the mapping ``digest`` (payload) that the next requests name; drop ``evict``."""

    COMMAND: ClassVar[str] = "SET_VOCAB (worker)"

    digest: str = ""
    evict: list[str] = dataclasses.field(default_factory=list)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> WorkerSetVocab:
        r = HeaderReader(cls.COMMAND, raw)
        return cls(digest=r.required_text("digest"), evict=_default(r.texts("evict"), []))


@dataclasses.dataclass(frozen=True)
class WorkerBind(WireMessage):
    """BIND, broker -> worker: serve ``client`` (hex identity) alone, under the binding ``prefix``."""

    COMMAND: ClassVar[str] = "BIND (worker)"

    client: str = ""
    reply_to: str = ""
    prefix: str = ""
    timeout: float = 30.0
    device_type: str | None = dataclasses.field(default=None, metadata=ALWAYS)
    data_key: str | None = None

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> WorkerBind:
        r = HeaderReader(cls.COMMAND, raw)
        bad = "BIND without reply_to, prefix or request id"
        return cls(client=r.required_text("client"), reply_to=r.required_text("reply_to", error=bad),
                   prefix=r.required_text("prefix", error=bad),
                   timeout=_default(r.number("timeout", positive=True), 30.0),
                   device_type=r.text("device_type", nullable=True), data_key=r.text("data_key", nullable=True))


@dataclasses.dataclass(frozen=True)
class Done(WireMessage):
    """DONE, worker -> broker: the reply left (``status`` ok/error/engine_dead) or could not (undeliverable),
    or a draining worker hands the request back unrun (returned): a ``DoneStatus``; the request's slot is
    free either way.
    ``bytes`` is the reply's payload size."""

    COMMAND: ClassVar[str] = "DONE"

    status: DoneStatus = DoneStatus.OK
    tokens: int | None = None
    nbytes: int | None = dataclasses.field(default=None, metadata={"key": "bytes"})
    via: str | None = None
    error: str | None = None

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Done:
        r = HeaderReader(cls.COMMAND, raw)
        status = r.text("status", ok=lambda v: v in _DONE_STATUSES,
                        error=f"DONE header 'status' must be one of {sorted(_DONE_STATUSES)}")
        return cls(status=DoneStatus(_default(status, DoneStatus.OK.value)), tokens=r.integer("tokens", minimum=0),
                   nbytes=r.integer("bytes", minimum=0), via=r.text("via"), error=r.text("error"))


@dataclasses.dataclass(frozen=True)
class Leave(WireMessage):
    """LEAVE, worker -> broker: forget me and re-queue what I hold (my engine died, or I stopped: ``reason``).
    With ``drain``: I was told to stop; send me nothing more, I finish or hand back (DONE ``returned``)
    what I hold, then LEAVE again without ``drain``."""

    COMMAND: ClassVar[str] = "LEAVE"

    reason: str | None = dataclasses.field(default=None, metadata=ALWAYS)
    drain: bool = False

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Leave:
        r = HeaderReader(cls.COMMAND, raw)
        return cls(reason=r.text("reason", nullable=True), drain=r.flag("drain"))


@dataclasses.dataclass(frozen=True)
class Disconnect(WireMessage):
    """DISCONNECT, broker -> worker: register again (READY). ``stopping``: the broker was told to stop; the
    READY reaches its successor. Broker -> client: you were silent past your liveness window and are
    forgotten: register your mappings and send what is pending again (never ``stopping``)."""

    COMMAND: ClassVar[str] = "DISCONNECT"

    stopping: bool = False

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Disconnect:
        return cls(stopping=HeaderReader(cls.COMMAND, raw).flag("stopping"))


# -------------------------------------------------------------------- worker -> client (data)


@dataclasses.dataclass(frozen=True)
class Reply(WireMessage):
    """DATA ok, worker -> client: a reply's header. Its tensors are the payload frames, or travel by the reply
    path that ``path`` names (``{name: its descriptor}``, spec_serve/paths/). ``digests`` when the request
    asked ``verify``; ``batched`` when it shared a packed forward; ``kind`` when the worker chose the reply's
    format (a request's ``format: auto``); ``wire_dtype`` when its hidden states travel in another dtype than
    the model's (``fp8``: each with its ``NAME_scale``)."""

    COMMAND: ClassVar[str] = "DATA"

    worker: str = ""
    compute_s: float | None = None
    batched: int | None = None
    kind: str | None = None
    wire_dtype: str | None = None
    path: Json | None = None  # {path name: its descriptor}: where the reply's bytes lie, if not in the frames
    fingerprint: str | None = None
    digests: dict[str, int] | None = None

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Reply:
        r = HeaderReader(cls.COMMAND, raw)
        digests = r.obj("digests")
        if digests is not None and not all(_is_int(v) for v in digests.values()):
            raise ProtocolError("DATA header 'digests' must map tensor names to integers")
        path = r.obj("path")
        if path is not None and len(path) != 1:
            raise ProtocolError("DATA header 'path' must name one reply path")
        return cls(worker=r.required_text("worker"), compute_s=r.number("compute_s"),
                   batched=r.integer("batched", minimum=1), kind=r.text("kind"), wire_dtype=_wire_dtype(r),
                   path=path,
                   fingerprint=r.text("fingerprint"), digests=digests)

    def descriptor(self, path: str) -> Any:
        """Where the reply path named ``path`` put the reply's bytes (a peer's JSON, for the path to check);
        None if the reply came another way."""
        return (self.path or {}).get(path)


@dataclasses.dataclass(frozen=True)
class Rendezvous(WireMessage):
    """Where a bound worker hosts the binding's rendezvous store (``bind`` of a BindGrant)."""

    COMMAND: ClassVar[str] = "DATA bind 'bind'"

    store_host: str = ""
    store_port: int = 0
    prefix: str = ""
    worker: str = ""
    timeout: float = 30.0

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Rendezvous:
        r = HeaderReader(cls.COMMAND, raw)
        return cls(store_host=r.required_text("store_host"), store_port=r.required_integer("store_port", minimum=0),
                   prefix=r.required_text("prefix"), worker=r.required_text("worker"),
                   timeout=_default(r.number("timeout", positive=True, required=True), 30.0))


@dataclasses.dataclass(frozen=True)
class BindGrant(WireMessage):
    """DATA ok answering a BIND, worker -> client: meet the worker at ``bind``."""

    COMMAND: ClassVar[str] = "DATA bind"

    worker: str = ""
    bind: Rendezvous = dataclasses.field(default_factory=Rendezvous)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> BindGrant:
        r = HeaderReader(cls.COMMAND, raw)
        worker = r.required_text("worker")
        return cls(worker=worker, bind=Rendezvous.from_json(_default(r.obj("bind", required=True), {})))


@dataclasses.dataclass(frozen=True)
class ErrorReply(WireMessage):
    """DATA error, worker -> client: the request failed on the worker; ``code`` is an ErrorCode value."""

    COMMAND: ClassVar[str] = "DATA error"

    worker: str = ""
    code: str = ""
    error: str = ""

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> ErrorReply:
        r = HeaderReader(cls.COMMAND, raw)
        return cls(worker=r.required_text("worker"), code=r.required_text("code"), error=r.required_text("error"))


# Every typed header, in the order docs/protocol.md lists them (its table is checked against these).
MESSAGES: tuple[type[WireMessage], ...] = (
    SupervisionRequest, BrokerHeartbeat, ClientHeartbeat, SetVocab, VocabOk, BrokerError, StatusQuery, StatusPage,
    BindRequest, Bound, Release, Ready, Refused, WorkerSetVocab, WorkerBind, Done, Leave, Disconnect, Reply, Rendezvous,
    BindGrant, ErrorReply,
)
