"""The broker's control messages to the requests they concern (the counterpart of worker_replies.py): an
answer resolves its request, an ERROR retries or fails it by its code, and a heartbeat from a new broker
instance (a restart) or a DISCONNECT (the broker forgot us) means every pending request and mapping goes
again. I/O thread only."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from spec_serve.client.errors import BrokerUnreachable, RemoteError
from spec_serve.client.pending import RETRY_BACKOFF_S, Pending, Requests
from spec_serve.client.received import Received
from spec_serve.client.vocab import VocabRegistrations
from spec_serve.client.worker_replies import WorkerReplies
from spec_serve.paths.registry import ClientPaths
from spec_serve.protocol.commands import CLIENT_TAG, ClientCommand, ErrorCode, parse_control
from spec_serve.protocol.messages import (
    Bound,
    BrokerError,
    BrokerHeartbeat,
    Disconnect,
    StatusPage,
    VocabOk,
    WireMessage,
)
from spec_serve.telemetry.logs import event
from spec_serve.transport.broker_link import BrokerLink

log = logging.getLogger("spec_serve.client")

# The typed header of each command the broker sends clients.
MESSAGES: dict[ClientCommand, type[WireMessage]] = {
    ClientCommand.ERROR: BrokerError, ClientCommand.HEARTBEAT: BrokerHeartbeat, ClientCommand.STATUS: StatusPage,
    ClientCommand.VOCAB_OK: VocabOk, ClientCommand.BOUND: Bound, ClientCommand.DISCONNECT: Disconnect,
}


class BrokerReplies:
    """What the broker says, for the client's pending requests. ``answered()``: any valid message (the link
    is up); ``misdirected(error)``: we reached the broker's workers' port; ``resend_all()``: the broker
    restarted; ``send(frames)``: a control message to the broker."""

    def __init__(self, link: BrokerLink, requests: Requests, vocab: VocabRegistrations, replies: WorkerReplies, *,
                 answered: Callable[[], None], misdirected: Callable[[BrokerUnreachable], None],
                 resend_all: Callable[[], None], send: Callable[[list], None]):
        self.link, self.requests, self.vocab, self.replies = link, requests, vocab, replies
        self.answered, self.misdirected, self.resend_all, self.send = answered, misdirected, resend_all, send
        self.paths: ClientPaths | None = None
        self.instance: str | None = None  # the broker's instance id, from its heartbeats

    def on_control(self, frames: list) -> None:
        msg = parse_control(frames, CLIENT_TAG, ClientCommand)
        command = ClientCommand(msg.command)
        header = MESSAGES[command].from_json(msg.header) if command in MESSAGES else None
        if isinstance(header, BrokerError) and header.code == ErrorCode.WRONG_PORT.value:
            self.misdirected(BrokerUnreachable(f"{self.link.broker_url}: {header.error}"))
            return
        self.answered()
        if isinstance(header, BrokerHeartbeat):
            self._on_heartbeat(header)
            return
        if isinstance(header, Disconnect):  # it forgot us (our heartbeats came too late)
            event(log, logging.WARNING, "client.forgotten_by_broker", broker=self.link.broker_url,
                  pending=len(self.requests.table))
            self.resend_all()
            return
        if self.paths is not None and header is not None:
            self.paths.on_broker(header)  # e.g. BOUND lost: our bound worker died (a pending BIND resolves below)
        pending = self.requests.table.get(msg.request_id)
        if pending is None or header is None:
            return
        if isinstance(header, BrokerError):
            self._on_refusal(pending, header)
        else:
            self.requests.resolve(pending, Received(msg.request_id, header, broker_command=command))

    def _on_heartbeat(self, beat: BrokerHeartbeat) -> None:
        """A new instance id: the broker restarted (everything goes again). ``stopping``: its last word (an
        outage starts now, one line; a successor's first heartbeat makes us send everything again)."""
        restarted = self.instance is not None and beat.broker != self.instance
        self.instance = beat.broker
        if restarted:
            event(log, logging.WARNING, "client.broker_restarted", broker=self.link.broker_url)
            self.resend_all()
        if beat.stopping:
            self.link.stopping(time.monotonic(), pending=len(self.requests.table))

    def _on_refusal(self, pending: Pending, refusal: BrokerError) -> None:
        """The broker's ERROR for a pending request: retry, or fail it with what the code means."""
        code, error = refusal.code, refusal.error
        now = time.monotonic()
        registration = self.vocab.registration(pending.vocab) if refusal.unknown_vocab else None
        if registration is not None:  # we hold the mapping it names (a restarted broker lacks it, or forgot us)
            self.send(registration)
            self.requests.behind_registration(pending, now, error)
        elif code in (ErrorCode.TIMEOUT.value, ErrorCode.UNAVAILABLE.value, ErrorCode.INTERNAL.value):
            self.requests.retry(pending, now, error, delay=RETRY_BACKOFF_S,
                                exhausted=TimeoutError if code == ErrorCode.TIMEOUT.value else RemoteError)
        elif code == ErrorCode.TARGET_CHANGED.value:
            self.replies.target_changed(pending, error, worker=None)
        elif code == ErrorCode.KILLED_WORKERS.value:
            self.requests.fail(pending, RemoteError(error))
        else:
            self.requests.fail(pending, ValueError(error))
