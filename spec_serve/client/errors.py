"""What the client raises besides ``ValueError`` (a bad request) and ``TimeoutError`` (no answer in time)."""

from __future__ import annotations


class RemoteError(RuntimeError):
    """A worker or the broker failed a request: the worker's engine died serving it (never retried), or
    every attempt got an error reply. The message names the worker and the error."""


class IntegrityError(RemoteError):
    """A reply's bytes, as landed here, differed from the worker's digest twice (two attempts, two workers
    where the service has two)."""


class TargetChangedError(RemoteError):
    """The service now serves another target (fingerprint) than this client set up with."""


class BrokerUnreachable(ConnectionError, TimeoutError):
    """No spec-serve broker answered at the client's address (or another kind of port did).

    A ``TimeoutError`` too, so code written for the older behaviour (every request timing out)
    still catches it.
    """
