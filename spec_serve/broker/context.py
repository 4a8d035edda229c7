"""What every part of the broker shares: the injected ``send``, the metrics, the liveness timers, and the
flag that says the status snapshot is out of date.

The broker's parts own no socket: everything they say goes through ``send(peer, identity, frames)``,
which returns False if the peer is gone or saturated, so each part runs under a test without sockets.
"""

from __future__ import annotations

import enum
import time
import uuid
from collections.abc import Callable

from spec_serve.protocol.commands import CLIENT_TAG, ClientCommand, ErrorCode, control
from spec_serve.protocol.messages import BrokerError
from spec_serve.telemetry.metrics import BrokerMetrics


class Peer(enum.Enum):
    """Whom a message goes to: the broker's frontend serves clients, its backend workers."""

    CLIENT = "client"
    WORKER = "worker"


Send = Callable[[Peer, bytes, list], bool]


class BrokerContext:
    """The send function, metrics and timers of one broker; single-threaded (the broker loop uses it)."""

    def __init__(self, send: Send, *, heartbeat_interval: float, liveness: int, metrics: BrokerMetrics | None = None):
        self.send = send
        self.metrics = metrics or BrokerMetrics()
        self.instance_id = uuid.uuid4().hex
        self.started_at = time.time()
        self.heartbeat_interval = heartbeat_interval
        self.liveness = liveness
        # Set when what status.py reports changed; the broker loop rebuilds its snapshot once per turn.
        self.status_stale = False

    @property
    def expiry_window(self) -> float:
        """Seconds a peer stays known without a message from it."""
        return self.heartbeat_interval * self.liveness

    def to_client(self, identity: bytes, frames: list) -> bool:
        return self.send(Peer.CLIENT, identity, frames)

    def to_worker(self, identity: bytes, frames: list) -> bool:
        return self.send(Peer.WORKER, identity, frames)

    def send_error(self, client: bytes, request_id: bytes, code: ErrorCode, message: str, *,
                   unknown_vocab: bool = False, unpinned: bool = False) -> None:
        self.metrics.errors.labels(code=code.value).inc()
        error = BrokerError(code=code.value, error=message, unknown_vocab=unknown_vocab, unpinned=unpinned)
        self.to_client(client, control(CLIENT_TAG, ClientCommand.ERROR.value, "", request_id, error))
