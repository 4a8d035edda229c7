"""Client state: who is connected, what each may hold at the broker, and the target each set up with.

Everything a client's message makes the broker keep is admitted here first: requests (a count per client
and the broker's held bytes), draft-vocab mappings (SET_VOCAB), and the target fingerprint a client pins.
"""

from __future__ import annotations

from collections.abc import Callable

from spec_serve.broker.context import BrokerContext
from spec_serve.broker.services import ServiceQueues
from spec_serve.broker.state import ClientState, Request, RequestTable
from spec_serve.broker.vocab_registry import BadMapping, VocabRegistry
from spec_serve.broker.workers import WorkerRegistry
from spec_serve.protocol.commands import CLIENT_TAG, ClientCommand, ErrorCode, Message, control
from spec_serve.protocol.messages import SetVocab, SupervisionRequest, VocabOk

# Requests one client may have queued or in flight at the broker; beyond this
# it is told to back off. Bounds broker memory whatever clients do.
MAX_REQUESTS_PER_CLIENT = 256
# Services one client names at a time (in admitted requests and mappings); each keeps its service known
# while the client is connected. An honest client names one; beyond this its least recent goes.
MAX_SERVICES_PER_CLIENT = 16
# Request and vocab-mapping payload bytes the broker holds at once (queued, in flight, stored);
# past it a new request is told to back off (unavailable, retried), a larger one is refused.
DEFAULT_MAX_HELD_BYTES = 1 << 30
# The share of --max-held-bytes one client (one connection) may hold, so that one peer cannot make the
# broker refuse everyone else; at least one request of the largest size.
DEFAULT_CLIENT_HELD_SHARE = 0.25


class ClientTable:
    """Connected clients by identity, and the admission of what they ask the broker to hold."""

    def __init__(self, ctx: BrokerContext, services: ServiceQueues, workers: WorkerRegistry, requests: RequestTable,
                 vocab: VocabRegistry, *, max_message_bytes: int, max_held_bytes: int,
                 client_held_share: float = DEFAULT_CLIENT_HELD_SHARE):
        self.ctx = ctx
        self.services = services
        self.workers = workers
        self.requests = requests
        self.vocab = vocab
        self.max_message_bytes = max_message_bytes
        self.max_held_bytes = max_held_bytes
        self.max_client_bytes = max(int(max_held_bytes * client_held_share), max_message_bytes)
        # Payload bytes promised to messages still arriving in parts (the broker's broker.parts.Parts), held
        # as much as stored ones: of one client identity, or of everyone for None.
        self.reserved: Callable[[bytes | None], int] = lambda identity: 0
        self.clients: dict[bytes, ClientState] = {}

    def get(self, identity: bytes) -> ClientState | None:
        return self.clients.get(identity)

    def seen(self, identity: bytes, now: float) -> ClientState:
        """The client that sent a message now, known from now on if it was not."""
        client = self.clients.get(identity)
        if client is None:
            client = self.clients[identity] = ClientState(identity, now)
            self.ctx.metrics.clients.set(len(self.clients))
        client.expiry = now + self.ctx.expiry_window
        return client

    def pop(self, identity: bytes) -> ClientState | None:
        client = self.clients.pop(identity, None)
        self.ctx.metrics.clients.set(len(self.clients))
        return client

    def pinned(self, service: str) -> list[str]:
        """The target fingerprint each connected client of ``service`` set up with."""
        return [c.fingerprints[service] for c in self.clients.values() if service in c.fingerprints]

    def uses(self, client: ClientState, service: str) -> None:
        """Note that ``client`` named ``service`` in something the broker admitted."""
        client.services[service] = None
        client.services.move_to_end(service)
        while len(client.services) > MAX_SERVICES_PER_CLIENT:
            client.services.popitem(last=False)

    def users(self, service: str) -> list[ClientState]:
        """The connected clients that named ``service``."""
        return [c for c in self.clients.values() if service in c.services]

    def in_use(self) -> set[str]:
        """The services connected clients named (in requests or mappings they hold): the ones clients ask for."""
        names = {name for client in self.clients.values() for name in client.services}
        names.update(name for client in self.clients.values() for name, _ in client.vocab)
        return names

    def forget_request(self, request: Request) -> None:
        """Drop ``request`` from the broker's table and from its client's count."""
        self.requests.pop(request.request_id, None)
        client = self.clients.get(request.client)
        if client is not None:
            client.requests.discard(request.request_id)

    # ------------------------------------------------------------------ requests

    def admit(self, client: ClientState, msg: Message, header: SupervisionRequest, now: float) -> int | None:
        """A new request's payload bytes if the broker takes it; None after answering why not."""
        if len(client.requests) >= MAX_REQUESTS_PER_CLIENT:
            self.ctx.send_error(client.identity, msg.request_id, ErrorCode.UNAVAILABLE,
                                f"more than {MAX_REQUESTS_PER_CLIENT} requests outstanding for this client")
            return None
        if not self.pin_target(client, msg, header.fingerprint):
            return None
        size = sum(len(memoryview(f)) for f in msg.payload)
        if size > self.max_message_bytes:
            self.ctx.send_error(client.identity, msg.request_id, ErrorCode.BAD_REQUEST,
                                f"request of {size} bytes exceeds the limit of {self.max_message_bytes}")
            return None
        if not self.can_hold(client, msg.request_id, size):
            return None
        vocab = header.vocab
        service = self.services.get(msg.service)
        if vocab is not None and (service is None or vocab not in service.mappings):
            self.ctx.send_error(client.identity, msg.request_id, ErrorCode.BAD_REQUEST,
                                f"unknown vocab mapping {vocab!r}: call set_vocab_mapping first", unknown_vocab=True)
            return None
        if self.services.unknown(msg.service, now):
            self.ctx.send_error(client.identity, msg.request_id, ErrorCode.UNKNOWN_SERVICE,
                                self.services.unknown_message(msg.service))
            return None
        self.uses(client, msg.service)
        return size

    def can_hold(self, client: ClientState, request_id: bytes, size: int) -> bool:
        """Room for ``size`` more payload bytes; if not, the client is told to back off (it retries)."""
        why = self.room(client.identity, size)
        if why is not None:
            self.ctx.send_error(client.identity, request_id, ErrorCode.UNAVAILABLE, why)
        return why is None

    def room(self, identity: bytes, size: int) -> str | None:
        """Why ``size`` more payload bytes from the client ``identity`` cannot be held now (None: they can):
        all clients together hold at most --max-held-bytes, one at most its share of it."""
        held = self.requests.held + self.vocab.held_bytes + self.reserved(None)
        if held + size > self.max_held_bytes:
            return (f"the broker holds {held} bytes of requests; {size} more would pass its limit of "
                    f"{self.max_held_bytes} (--max-held-bytes)")
        client = self.clients.get(identity)
        mine = self.reserved(identity) + sum(self.requests[r].size for r in (client.requests if client else ())
                                             if r in self.requests)
        if mine + size > self.max_client_bytes:
            return (f"this client already has {mine} bytes of requests at the broker; {size} more would pass its "
                    f"share of {self.max_client_bytes} (--client-held-share of --max-held-bytes)")
        return None

    def pin_target(self, client: ClientState, msg: Message, fingerprint: str | None) -> bool:
        """Note the target ``fingerprint`` a client's message names (the one it set up with); False, after
        answering ``target_changed``, if the service's workers now serve another."""
        if fingerprint is None:
            return True
        serving = self.workers.serving_fingerprint(msg.service)
        if serving is not None and serving != fingerprint:
            self.ctx.send_error(client.identity, msg.request_id, ErrorCode.TARGET_CHANGED,
                                f"service {msg.service!r} now serves target fingerprint {serving}, but this client set "
                                f"up with {fingerprint}: start a new client to use the new target")
            return False
        client.fingerprints[msg.service] = fingerprint
        return True

    # ------------------------------------------------------------------ vocab mappings

    def register_mapping(self, client: ClientState, msg: Message, header: SetVocab, now: float) -> None:
        """SET_VOCAB: store a client's mapping (content-addressed) after dropping the registrations it
        releases; answer VOCAB_OK with its digest."""
        if not self.pin_target(client, msg, header.fingerprint):
            return
        self.vocab.release(client, msg.service, header.release or [])
        known = self.services.get(msg.service)
        try:
            digest = self.vocab.digest(msg.payload, known.vocab_size if known else None)
        except BadMapping as e:
            self.ctx.send_error(client.identity, msg.request_id, ErrorCode.BAD_REQUEST, str(e))
            return
        service = self.services.service(msg.service, now)
        if digest not in service.mappings:
            if not self.can_hold(client, msg.request_id, sum(len(memoryview(f)) for f in msg.payload)):
                return
            self.vocab.store(service, digest, msg.payload)
        self.vocab.keep(client, msg.service, digest)
        self.uses(client, msg.service)
        self.trim_mappings()
        self.ctx.to_client(client.identity, control(
            CLIENT_TAG, ClientCommand.VOCAB_OK.value, msg.service, msg.request_id, VocabOk(digest)))

    def trim_mappings(self) -> None:
        self.vocab.trim(self.services, self.clients.values(), self.requests)
