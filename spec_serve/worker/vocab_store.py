"""The draft-vocab mappings a worker holds, by digest, and which one its engine has selected.

The broker sends a mapping (SET_VOCAB) ahead of the requests that name it, and says which to drop.
The I/O thread stores; the compute thread looks up and selects.
"""

from __future__ import annotations

import collections
import logging
import threading

import torch

from spec_serve.engines.base import TargetEngine
from spec_serve.protocol import wire
from spec_serve.protocol.commands import ErrorCode, Message, ProtocolError
from spec_serve.protocol.messages import WorkerSetVocab
from spec_serve.supervision.contract import Kind
from spec_serve.telemetry.logs import event
from spec_serve.worker.jobs import RequestError

log = logging.getLogger("spec_serve.worker")

# A worker holds at most MAX_MAPPINGS + capacity draft-vocab mappings. The broker says which to drop
# (SET_VOCAB "evict") and never leaves more than 16 on a worker plus those its requests in flight name;
# dropping the oldest beyond this bound only guards against a broker that misbehaves.
MAX_MAPPINGS = 16

Mapping = tuple[torch.Tensor, torch.Tensor]  # (selected_token_ids, selected_token_mask)


class VocabStore:
    def __init__(self, worker: str, capacity: int, max_message_bytes: int):
        self.worker = worker
        self.limit = MAX_MAPPINGS + capacity
        self.max_message_bytes = max_message_bytes
        self._mappings: collections.OrderedDict[str, Mapping] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._selected: str | None = None  # the digest the engine holds; compute thread only

    def store(self, msg: Message) -> None:
        """I/O thread: keep the mapping a SET_VOCAB carries and drop those it evicts (a bad one is logged)."""
        try:
            header = WorkerSetVocab.from_json(msg.header)
            tensors = wire.decode(msg.payload, max_bytes=self.max_message_bytes)
            mapping = (tensors["selected_token_ids"].clone(), tensors["selected_token_mask"].clone())
        except (ProtocolError, wire.WireError, KeyError) as e:
            event(log, logging.WARNING, "worker.bad_mapping", digest=msg.header.get("digest"), error=e)
            return
        self.put(header.digest, mapping, header.evict)

    def put(self, digest: str, mapping: Mapping, evict: list | None = None) -> None:
        """Hold ``mapping`` under ``digest`` (newest), after dropping the digests in ``evict``."""
        with self._lock:
            for old in evict or ():
                if isinstance(old, str):
                    self._mappings.pop(old, None)
            self._mappings[digest] = mapping
            self._mappings.move_to_end(digest)
            while len(self._mappings) > self.limit:
                self._mappings.popitem(last=False)

    def clear(self) -> None:
        """Registering anew: the broker's record of what we hold starts empty with this READY."""
        with self._lock:
            self._mappings.clear()

    def get(self, digest: str | None) -> Mapping:
        """The mapping ``digest`` names; ``RequestError`` if none (BAD_REQUEST) or not held (INTERNAL)."""
        if not isinstance(digest, str):
            raise RequestError(ErrorCode.BAD_REQUEST, "EAGLE-3 needs a draft-vocab mapping: call set_vocab_mapping")
        with self._lock:
            mapping = self._mappings.get(digest)
        if mapping is None:
            # The broker sends mappings ahead of requests; missing means a race
            # with a restart. INTERNAL makes the client retry.
            raise RequestError(ErrorCode.INTERNAL, f"worker {self.worker} lacks vocab mapping {digest}")
        return mapping

    def select(self, engine: TargetEngine, kind: Kind, digest: str | None) -> None:
        """Compute thread: give ``engine`` the mapping an EAGLE-3 request names, unless it holds it already."""
        # Compact EAGLE-3 uses no mapping (the client expands it): one is selected only when named, so a
        # supervision cache can be filled without one (spec-serve capture).
        if kind is Kind.EAGLE3 or (kind is Kind.EAGLE3_COMPACT and digest is not None):
            if digest != self._selected or not isinstance(digest, str):
                # get refuses a missing digest as BAD_REQUEST (never retried)
                engine.set_vocab_mapping(*self.get(digest))
                self._selected = digest
