"""The broker's draft-vocab mappings: stored per service by content digest, kept only while live,
and an exact record of which mappings each worker holds (the broker decides what a worker evicts).

Pure bookkeeping: it builds the SET_VOCAB a worker needs but sends nothing (dispatch.py does).
"""

from __future__ import annotations

from collections.abc import Iterable

from spec_serve.broker.state import ClientState, RequestTable, ServiceState, WorkerState
from spec_serve.protocol import wire_format
from spec_serve.protocol.commands import WORKER_TAG, WorkerCommand, control
from spec_serve.protocol.messages import WorkerSetVocab
from spec_serve.supervision.vocab_rule import mapping_digest, validate_mapping

# Draft-vocab mappings one client keeps registered (per service and in all); an honest client needs its
# current one plus those its pending requests name. Beyond this its oldest registration is dropped.
MAX_MAPPINGS_PER_CLIENT = 16
# Mappings the broker keeps on one worker. The broker decides which a worker drops (SET_VOCAB "evict"),
# so its record of what a worker holds is exact; one named by a request on that worker is never evicted.
MAX_WORKER_MAPPINGS = 16


class BadMapping(ValueError):
    """A SET_VOCAB payload that is not a valid mapping; the message is the client's error text."""


class VocabRegistry:
    """Mappings by service and digest; ``held_bytes`` is the payload bytes of those stored."""

    def __init__(self, max_message_bytes: int):
        self.max_message_bytes = max_message_bytes
        self.held_bytes = 0

    def digest(self, payload: list, vocab_size: int | None) -> str:
        """The digest of the mapping a SET_VOCAB ``payload`` carries, checked against ``vocab_size``; read
        as numpy arrays (the broker never imports torch)."""
        try:
            spans, _ = wire_format.parse_raw(payload, max_bytes=self.max_message_bytes)
            ids, mask = spans["selected_token_ids"].array(), spans["selected_token_mask"].array()
            validate_mapping(ids, mask, vocab_size)
        except (KeyError, ValueError) as e:  # WireError is a ValueError
            raise BadMapping(f"bad vocab mapping: {e}") from None
        return mapping_digest(ids, mask)

    @staticmethod
    def store(service: ServiceState, digest: str, payload: list) -> None:
        service.mappings[digest] = [bytes(memoryview(f)) for f in payload]

    @staticmethod
    def release(client: ClientState, service: str, digests: Iterable[str]) -> None:
        for digest in digests:
            client.vocab.pop((service, digest), None)

    @staticmethod
    def keep(client: ClientState, service: str, digest: str) -> None:
        """Note ``client``'s registration of ``digest``, dropping its oldest past MAX_MAPPINGS_PER_CLIENT."""
        client.vocab[(service, digest)] = None
        client.vocab.move_to_end((service, digest))
        while len(client.vocab) > MAX_MAPPINGS_PER_CLIENT:
            client.vocab.popitem(last=False)

    def trim(self, services: Iterable[ServiceState], clients: Iterable[ClientState], requests: RequestTable) -> None:
        """Keep only live mappings: registered (and not released) by a connected client, or named by a
        request the broker holds. Workers keep their own copies until the broker evicts them."""
        services = list(services)
        live = {key for client in clients for key in client.vocab}
        live.update((r.service, r.header.vocab) for r in requests.values() if r.header.vocab is not None)
        for service in services:
            for digest in [d for d in service.mappings if (service.name, d) not in live]:
                del service.mappings[digest]
        self.held_bytes = sum(len(f) for service in services for frames in service.mappings.values()
                              for f in frames)

    def install(self, service: ServiceState, worker: WorkerState, digest: str, requests: RequestTable) -> list | None:
        """The SET_VOCAB that gives ``worker`` the mapping ``digest`` (the service holds it), recorded as
        held; None if it holds it already (then marked most recently used). Sent on the same pipe just
        before the request that names it, so it arrives first."""
        if digest in worker.mappings:
            worker.mappings.move_to_end(digest)
            return None
        header = WorkerSetVocab(digest=digest, evict=self._evict(worker, requests))
        worker.mappings[digest] = None
        return control(WORKER_TAG, WorkerCommand.SET_VOCAB.value, service.name, b"", header,
                       service.mappings[digest])

    @staticmethod
    def _evict(worker: WorkerState, requests: RequestTable) -> list[str]:
        """Make room on ``worker`` for one more mapping: drop its least recently used ones that no
        request on it names. The worker drops exactly these, so ``worker.mappings`` stays exact."""
        in_use = {requests[r].header.vocab for r in worker.inflight if r in requests}
        evicted = []
        for digest in list(worker.mappings):
            if len(worker.mappings) < MAX_WORKER_MAPPINGS:
                break
            if digest not in in_use:
                del worker.mappings[digest]
                evicted.append(digest)
        return evicted
