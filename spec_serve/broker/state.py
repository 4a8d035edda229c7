"""What the broker knows: its records of workers, requests, clients and services.

Plain records, no behaviour beyond derived fields; the parts routing.py puts together decide on them.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from spec_serve.broker.sizing import Window
from spec_serve.protocol.messages import SupervisionRequest


@dataclasses.dataclass
class WorkerState:
    identity: bytes
    service: str
    info: dict[str, Any]
    capacity: int
    expiry: float
    registered_at: float
    inflight: set = dataclasses.field(default_factory=set)
    # digests this worker holds, least recently used first (it drops only what SET_VOCAB evicts)
    mappings: collections.OrderedDict[str, None] = dataclasses.field(default_factory=collections.OrderedDict)
    max_message_bytes: int | None = None
    host: str | None = None  # as the worker's READY said (for people: error messages, logs)
    host_key: str | None = None  # as the worker's READY said: requests ``near`` it prefer this worker
    pid: int | None = None
    bound_to: bytes | None = None
    bind_prefix: str | None = None  # the binding's rendezvous prefix (unique per binding)
    bind_request: bytes = b""  # the client's BIND request id
    bound_at: float = 0.0  # monotonic time of the BIND
    idle_since: float = 0.0  # monotonic time of its last DONE (or registration)
    completed: int = 0
    leaving: bool = False  # its engine died, or it drains: no more requests; LEAVE follows its last answers
    draining: bool = False  # it was told to stop (LEAVE with drain): its final LEAVE is no death
    # Supply (supply.py): tokens of its ok DONEs; seconds it held a request, and since when it holds one now
    # (kept in step with ``inflight`` by ``hold`` and ``let_go``: every request goes on and off it through them,
    # but for a gone worker's, which ``Dispatcher.orphan`` clears at once).
    tokens: int = 0
    busy_s: float = 0.0
    busy_since: float | None = None
    window: Window | None = None  # (tokens, busy seconds), sampled each tick

    def busy_until(self, now: float) -> float:
        """Seconds it held at least one request, up to ``now``."""
        return self.busy_s + (now - self.busy_since if self.busy_since is not None else 0.0)

    def hold(self, request_id: bytes, now: float) -> None:
        """``request_id`` is on it from ``now``: its busy interval opens if it held none."""
        if not self.inflight:
            self.busy_since = now
        self.inflight.add(request_id)

    def let_go(self, request_id: bytes, now: float) -> None:
        """``request_id`` is no longer on it: its busy interval closes if it holds none now."""
        self.inflight.discard(request_id)
        if not self.inflight and self.busy_since is not None:
            self.busy_s += now - self.busy_since
            self.busy_since = None

    @property
    def name(self) -> str:
        return self.identity.hex()[:12]

    @property
    def where(self) -> str:
        """Its name, with the host and process it said it runs as."""
        known = [f"host {self.host}" if self.host else "", f"pid {self.pid}" if self.pid is not None else ""]
        known = [k for k in known if k]
        return f"{self.name} ({', '.join(known)})" if known else self.name

    @property
    def free(self) -> int:
        return 0 if self.leaving else self.capacity - len(self.inflight)


@dataclasses.dataclass
class Request:
    request_id: bytes
    client: bytes
    service: str
    header: SupervisionRequest
    payload: list
    deadline: float
    enqueued_at: float
    size: int = 0  # payload bytes, counted in the broker's held bytes
    worker: bytes | None = None
    dispatches: int = 0
    killed: list = dataclasses.field(default_factory=list)  # workers that died while it was on them
    dispatched_at: float = 0.0
    missed: set = dataclasses.field(default_factory=set)  # workers that held it past its timeout


class RequestTable(dict[bytes, Request]):
    """request id -> Request that keeps ``held``, the sum of its requests' payload bytes."""

    held = 0

    def __setitem__(self, request_id: bytes, request: Request) -> None:
        self.pop(request_id, None)
        super().__setitem__(request_id, request)
        self.held += request.size

    def __delitem__(self, request_id: bytes) -> None:
        self.held -= self[request_id].size
        super().__delitem__(request_id)

    def pop(self, request_id: bytes, *default: Any) -> Any:  # Any: dict.pop's two overloads in one
        if request_id in self:
            self.held -= self[request_id].size
        return super().pop(request_id, *default)


@dataclasses.dataclass
class ClientState:
    identity: bytes
    expiry: float
    requests: set = dataclasses.field(default_factory=set)
    # service -> target fingerprint this client set up with (from its requests); a worker serving
    # another target may not join that service while the client is known.
    fingerprints: dict = dataclasses.field(default_factory=dict)
    # (service, digest) of the mappings it registered and has not released, oldest first
    vocab: collections.OrderedDict[tuple[str, str], None] = dataclasses.field(
        default_factory=collections.OrderedDict)
    # the services its admitted requests and mappings named, least recent first (ClientTable.uses bounds it)
    services: collections.OrderedDict[str, None] = dataclasses.field(default_factory=collections.OrderedDict)
    # Demand (supply.py): the service its heartbeats report for, its last report (broker time, wait, compute as
    # sent), and the seconds it waited and computed as the broker accepted them (clamped, never decreasing).
    report_service: str | None = None
    last_report: tuple[float, float, float] | None = None
    wait_s: float = 0.0
    compute_s: float = 0.0
    window: Window | None = None  # (wait, compute), sampled each tick


@dataclasses.dataclass
class ServiceState:
    name: str
    created_at: float  # monotonic; a name no worker ever served is unknown UNKNOWN_SERVICE_GRACE after this
    workers: list = dataclasses.field(default_factory=list)
    # client identity -> queued request ids; rotated for fairness.
    queues: collections.OrderedDict[bytes, collections.deque] = dataclasses.field(
        default_factory=collections.OrderedDict
    )
    # digest -> payload frames as bytes; only live mappings (see VocabRegistry.trim)
    mappings: dict = dataclasses.field(default_factory=dict)
    vocab_size: int | None = None
    # Demand and queueing (supply.py): tokens asked in admitted generate REQUESTs; when each client last
    # asked; (when, seconds) each dispatch waited in the queue, the window's only.
    asked: int = 0
    askers: dict = dataclasses.field(default_factory=dict)
    queue_waits: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=4096))
    window: Window | None = None  # (asked,), sampled each tick

    def queue_depth(self) -> int:
        return sum(len(q) for q in self.queues.values())
