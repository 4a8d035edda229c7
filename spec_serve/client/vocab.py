"""The draft-vocab mappings this client registered at the broker, kept to register them again."""

from __future__ import annotations

from collections.abc import Iterable

from spec_serve.protocol.commands import CLIENT_TAG, ClientCommand, control, new_request_id
from spec_serve.protocol.messages import SetVocab


class VocabRegistrations:
    """digest -> (service, SET_VOCAB payload) of the mappings registered at the broker and not released:
    the current one and any that pending requests name. Re-sent after a broker restart. I/O thread only."""

    def __init__(self) -> None:
        self._by_digest: dict[str, tuple[str, list]] = {}
        self.current: str | None = None

    def holds(self, digest: str | None) -> bool:
        return digest in self._by_digest

    def release_unnamed(self, named: Iterable[str | None]) -> list[str]:
        """Forget the mappings no pending request names (``named``); their digests, for ``release``."""
        keep = set(named)
        released = [d for d in self._by_digest if d not in keep]
        for d in released:
            del self._by_digest[d]
        return released

    def record(self, digest: str, service: str, payload: list) -> None:
        """The broker answered VOCAB_OK with ``digest``: the current mapping now."""
        self._by_digest[digest] = (service, payload)
        self.current = digest

    def registration(self, digest: str | None) -> list | None:
        """The frames that register ``digest`` again (None if we do not hold it)."""
        if digest not in self._by_digest:
            return None
        service, payload = self._by_digest[digest]
        return control(CLIENT_TAG, ClientCommand.SET_VOCAB.value, service, new_request_id(), SetVocab(), payload)

    def all_registrations(self) -> list[list]:
        """Frames registering every mapping we hold, the current one last (so it stays current)."""
        order = [d for d in self._by_digest if d != self.current] + [self.current]
        return [frames for frames in map(self.registration, order) if frames is not None]
