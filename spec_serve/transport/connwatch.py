"""Why a connecting socket has not reached its peer: ZeroMQ's monitor events, read as a likely cause.

A DEALER's ``connect`` never fails: libzmq retries in the background, silently. The client and the
worker watch their broker socket's monitor events so that, when the broker never answers, the error
can say whether nothing listens there, something that is not ZeroMQ does, or a handshake was refused.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

import zmq
from zmq.utils.monitor import recv_monitor_message

from spec_serve.transport.sockets import KEYS_DIR_FLAG

_WATCHED = (zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED
            | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class ConnectWatch:
    """Records which connection events one socket has seen; :meth:`cause` puts them in words.

    Used only by the thread that owns the socket; :meth:`close` before the socket is closed.
    """

    def __init__(self, sock: zmq.SyncSocket, url: str, role: str):
        self.url = url
        self.role = role  # the broker admits our key for it: client (frontend) or worker (backend)
        self.seen = 0  # OR of the zmq.EVENT_* bits observed
        self.disconnects = 0  # connections that ended, ever (read_disconnects: those since the last call)
        self._disconnects_read = 0
        self.monitor = sock.get_monitor_socket(_WATCHED)
        self._sock = sock

    def read(self) -> None:
        """Take in every pending event (non-blocking)."""
        while True:
            try:
                message = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            self.seen |= int(message["event"])
            self.disconnects += int(message["event"]) == zmq.EVENT_DISCONNECTED

    def read_disconnects(self) -> int:
        """Connections that ended since the last call (whatever ended them: the peer, a cut, the network)."""
        self.read()
        new, self._disconnects_read = self.disconnects - self._disconnects_read, self.disconnects
        return new

    def cause(self) -> str:
        """The likely reason no peer has answered, from what was seen so far."""
        self.read()
        host = urlsplit(self.url).hostname if self.url.startswith("tcp://") else None
        if self.seen & zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return (f"the peer refused our CURVE credentials: this public key is not in the broker's "
                    f"{KEYS_DIR_FLAG[self.role]}, or the server key is not the broker's")
        if self.seen & (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
            return ("a TCP connection was made but the ZeroMQ handshake failed: that port belongs to another "
                    "program (the broker's HTTP port, say), or the two ends' CURVE settings or keys differ")
        if self.seen & zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return "a ZeroMQ peer accepted the connection but never answered: it is not a spec-serve broker"
        if self.seen & zmq.EVENT_CONNECTED:
            return ("a TCP connection was made but no ZeroMQ peer answered: that port belongs to another "
                    "program (the broker's HTTP port, say)")
        if host and not _resolvable(host):
            return f"the host name {host!r} does not resolve"
        return ("nothing accepts connections there (refused or unreachable): the broker is not running, or "
                "not at this host and port")

    def close(self) -> None:
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass  # the socket is already closed
        self.monitor.close(0)


def connect_watched(sock: zmq.SyncSocket, url: str, role: str) -> ConnectWatch:
    """Connect ``sock`` to ``url`` as ``role`` (client, worker) with a watch attached first (so no early
    event is missed); on a failure the socket is closed and the error raised."""
    watch = ConnectWatch(sock, url, role)
    try:
        sock.connect(url)
    except BaseException:
        watch.close()
        sock.close(0)
        raise
    return watch


def _resolvable(host: str) -> bool:
    try:
        socket.getaddrinfo(host, None)
        return True
    except (OSError, UnicodeError):
        return False
