"""Checks of the header fields clients send the broker that more than one handler reads."""

from __future__ import annotations

from typing import Any

from spec_serve.protocol.commands import ProtocolError


def request_timeout(header: dict[str, Any]) -> float:
    """The request's ``timeout`` header (seconds), checked: a finite positive number."""
    timeout = header.get("timeout", 120)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < 1e7:
        raise ProtocolError(f"REQUEST header 'timeout' must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


def valid_endpoint(endpoint: Any) -> bool:
    """A ``reply_to`` a worker may connect to: ``tcp://host:port`` or ``ipc://path``."""
    if not isinstance(endpoint, str) or len(endpoint) > 512:
        return False
    if endpoint.startswith("ipc://"):
        return len(endpoint) > 6 and "\x00" not in endpoint
    if not endpoint.startswith("tcp://"):
        return False
    host, _, port = endpoint[6:].rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536 and "*" not in host
