"""One factory owns every ZeroMQ socket option, so peers cannot drift apart.

Options and why:
- LINGER 0: a closing peer never blocks on unsent bulk bytes.
- ROUTER_MANDATORY: a reply to a vanished peer raises instead of being
  dropped silently, so the broker can account for it.
- small high-water marks: they count messages, not bytes, and one message may
  be hundreds of MiB; flow control is done with credits above this layer.
- MAXMSGSIZE: libzmq refuses any frame above this before allocating it. The
  codec splits tensors into frames of at most 1 MiB (wire.MAX_FRAME_BYTES),
  so honest peers never come near it.
- ZMTP heartbeats and TCP keepalive: a cut link is noticed by libzmq too.
- IPV6: ``tcp://[::1]:5555`` and IPv6 host names work (off, libzmq answers them "No such device"); a
  ``tcp://*`` bind listens on IPv4 and IPv6 both (libzmq falls back to IPv4 where the host has no IPv6).
  Off for a bind to an IPv4 address, which stays a plain IPv4 listener (not a v4-mapped IPv6 one).
- IMMEDIATE (``immediate=True``, a worker's sockets to client data endpoints):
  messages queue only on a connection that completed its handshake, so a
  send to an endpoint that refuses or never speaks ZeroMQ fails at once.
- CurveZMQ when a Security is given: the broker's frontend admits the client
  keys, its backend the worker keys, and a client's data socket the worker keys,
  each socket with its own ZAP domain and policy (KeyPolicy).

Protected mode (``check_exposure``): every listener of the project (the broker's two ports, the HTTP
shims, a reply path's rendezvous) binds loopback only unless its process authenticates peers with CURVE or
was told ``--insecure-network``, as Redis does without a password.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import logging
import os
import shutil
import socket
import tempfile
import threading
import uuid
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from spec_serve.protocol.wire_format import MAX_FRAME_BYTES
from spec_serve.telemetry.logs import event

log = logging.getLogger("spec_serve.security")

# A frame carries at most one codec chunk plus a little framing slack.
DEFAULT_MAX_FRAME_BYTES = MAX_FRAME_BYTES + (1 << 20)
# The whole message (all frames together) a peer accepts, checked by the codec.
DEFAULT_MAX_MESSAGE_BYTES = int(os.environ.get("SPEC_SERVE_MAX_MESSAGE_BYTES", 8 << 30))
DEFAULT_HWM = 64


@dataclasses.dataclass(frozen=True)
class Security:
    """CurveZMQ settings for one peer.

    ``secret_key_file``: this peer's ``*.key_secret`` (from ``spec-serve keygen``).
    ``server_key_file``: the broker's public ``*.key`` (peers that connect to it).
    ``client_keys_dir``: the broker's frontend admits these clients' public keys.
    ``worker_keys_dir``: the broker's backend admits these workers' public keys, and a client's
    data socket admits replies from them (the same directory); without it a client gets no replies.
    """

    secret_key_file: Path
    server_key_file: Path | None = None
    client_keys_dir: Path | None = None
    worker_keys_dir: Path | None = None

    def keypair(self) -> tuple[bytes, bytes]:
        public, secret = zmq.auth.load_certificate(str(self.secret_key_file))
        if secret is None:
            raise ValueError(f"{self.secret_key_file} holds no secret key")
        return public, secret

    def server_public_key(self) -> bytes:
        if self.server_key_file is None:
            raise ValueError("this peer connects with CURVE but was given no server key file")
        public, _ = zmq.auth.load_certificate(str(self.server_key_file))
        return public


# The broker flag whose directory admits each role's CURVE keys.
KEYS_DIR_FLAG = {"client": "--curve-client-keys-dir", "worker": "--curve-worker-keys-dir"}
# Called from the ZAP thread with a refused peer's address and the role its socket admits.
OnRefused = Callable[[str, str], None]


class KeyPolicy:
    """The CURVE keys one server socket admits: the public keys (``*.key``) in ``directory``, read
    once; None admits nobody. A socket's policy lives as long as the object does (its owner holds it):
    once it is gone, the socket admits nobody. ``role`` names who the socket admits (client, worker);
    ``on_refused(address, role)`` hears of each peer whose key it refused (on the ZAP handler's thread)."""

    def __init__(self, directory: Path | None, role: str = "peer", on_refused: OnRefused | None = None):
        if directory is not None and not Path(directory).is_dir():
            raise ValueError(f"CURVE key directory {directory} does not exist (make keys with spec-serve keygen)")
        self.keys = frozenset(zmq.auth.load_certificates(str(directory))) if directory is not None else frozenset()
        self.domain = f"spec-serve-{uuid.uuid4().hex}"  # the socket's ZAP domain
        self.role = role
        self.on_refused = on_refused


class _Policies:
    """The ZAP credentials provider of one context: each request goes to the policy of its socket's domain
    (a context has one ZAP handler; without domains, the first socket's policy would answer for all).
    ``address``: the peer of the request being answered (set by ``_Authenticator``, on its thread)."""

    def __init__(self) -> None:
        self.by_domain: weakref.WeakValueDictionary[str, KeyPolicy] = weakref.WeakValueDictionary()
        self.address = ""

    def callback(self, domain: str, key: bytes) -> bool:
        policy = self.by_domain.get(domain)
        admitted = policy is not None and key in policy.keys
        if not admitted and policy is not None and policy.on_refused is not None:
            policy.on_refused(self.address, policy.role)
        return admitted


class _Authenticator(ThreadAuthenticator):
    """pyzmq's ZAP handler thread, telling the credentials provider which peer address asks (pyzmq passes
    it only the domain and the key)."""

    def __init__(self, context: zmq.SyncContext, policies: _Policies):
        super().__init__(context)
        self.policies = policies

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self.policies.address = plain_address(msg[3].decode(errors="replace") if len(msg) > 3 else "")
        await super().handle_zap_message(msg)


def plain_address(address: str) -> str:
    """An IPv4 peer of a dual-stack listener (``::ffff:10.0.0.5``) as its IPv4 address; others unchanged."""
    return address.removeprefix("::ffff:") if "." in address else address


_authenticators: dict[int, tuple[_Authenticator, _Policies]] = {}
_auth_lock = threading.Lock()


def _admit(sock: zmq.SyncSocket, policy: KeyPolicy) -> None:
    """Make ``sock`` a CURVE server that admits exactly ``policy``'s keys (one ZAP handler per context)."""
    with _auth_lock:
        entry = _authenticators.get(id(sock.context))
        if entry is None:
            policies = _Policies()
            auth = _Authenticator(sock.context, policies)
            auth.start()
            entry = _authenticators[id(sock.context)] = (auth, policies)
        auth, policies = entry
        policies.by_domain[policy.domain] = policy
        auth.configure_curve_callback(domain=policy.domain, credentials_provider=policies)
    sock.zap_domain = policy.domain.encode()
    sock.curve_server = True


def make_socket(
    ctx: zmq.SyncContext,
    kind: int,
    *,
    bind: str | None = None,
    connect: str | None = None,
    identity: bytes | None = None,
    security: Security | None = None,
    admit: KeyPolicy | None = None,
    curve_server_key: bytes | None = None,
    hwm: int = DEFAULT_HWM,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    immediate: bool = False,
) -> zmq.SyncSocket:
    """Create a socket with the project's options; bind or connect it.

    With ``security``: ``admit`` makes it a CURVE server admitting that policy's keys (the caller
    keeps the policy); otherwise a CURVE client of the broker, or of ``curve_server_key`` (a worker
    connecting to a client's data socket learns that key from the request).
    """
    sock: zmq.SyncSocket = ctx.socket(kind)
    try:
        _configure(sock, kind, bind, connect, identity, security, admit, curve_server_key, hwm, max_frame_bytes,
                   immediate)
    except BaseException:
        sock.close(0)  # a bad endpoint or key must not leak the socket
        raise
    return sock


def _configure(sock: zmq.SyncSocket, kind: int, bind: str | None, connect: str | None, identity: bytes | None,
               security: Security | None, admit: KeyPolicy | None, curve_server_key: bytes | None, hwm: int,
               max_frame_bytes: int, immediate: bool) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IMMEDIATE, int(immediate))
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 30)
    sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10000)
    sock.setsockopt(zmq.IPV6, 1)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if security is not None:
        public, secret = security.keypair()
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        if admit is not None:
            _admit(sock, admit)
        else:
            sock.curve_serverkey = curve_server_key or security.server_public_key()
    if bind is not None:
        bind_endpoint(sock, bind)
    if connect is not None:
        sock.connect(connect)


def bind_endpoint(sock: zmq.SyncSocket, endpoint: str) -> None:
    """Bind ``sock`` to ``endpoint``: a plain IPv4 listener for an IPv4 address (with IPV6 on, libzmq would
    make it a v4-mapped IPv6 one), IPv6 (and IPv4 for ``*``) otherwise."""
    sock.setsockopt(zmq.IPV6, int(not _is_ipv4(endpoint_host(endpoint))))
    sock.bind(endpoint)


def _is_ipv4(host: str | None) -> bool:
    try:
        return host is not None and ipaddress.ip_address(host).version == 4
    except ValueError:
        return False


def send_lent(sock: zmq.SyncSocket, frames: Iterable[Any], flags: int = 0) -> zmq.MessageTracker:
    """Send a multipart message whose frames borrow memory the caller will reuse; return a tracker
    that is done only once libzmq has let go of *every* frame.

    ``send_multipart(copy=False, track=True)`` is not enough: it returns the tracker of the last frame
    only, and pyzmq copies any frame under the socket's ``copy_threshold`` and gives it a tracker that
    is done at once. A reply ending in a small frame looked sent while its large frames were still
    queued (issue 12). Here each frame is a zero-copy ``zmq.Frame`` with its own tracker, whatever its
    size or position, and the caller keeps no frame object (a live one would hold its tracker open).
    """
    lent = [zmq.Frame(f, track=True, copy=False) for f in frames]
    tracker = zmq.MessageTracker(*lent)
    sock.send_multipart(lent, flags=flags, copy=False, track=True)
    return tracker


def bound_endpoint(sock: zmq.SyncSocket) -> str:
    """The endpoint a socket bound to, with the real port of a ``:*`` bind."""
    endpoint: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return endpoint


def keygen(directory: Path, name: str) -> tuple[Path, Path]:
    """Write a CURVE keypair ``name.key`` / ``name.key_secret`` into ``directory``; the secret 0600.

    Both are made in a private (0700) scratch directory and moved in, so the secret is never
    readable by others, not even for a moment.
    """
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".keygen-") as scratch:
        made = [Path(p) for p in zmq.auth.create_certificates(scratch, name)]
        os.chmod(made[1], 0o600)
        os.chmod(made[0], 0o644)
        public, secret = (directory / p.name for p in made)
        os.replace(made[0], public)
        os.replace(made[1], secret)
    return public, secret


INSECURE_NETWORK_FIX = "--insecure-network (env SPEC_SERVE_INSECURE_NETWORK=1)"
# Hosts that mean "every interface" when bound.
_ANY_HOST = ("", "*", "0.0.0.0", "::")


class ExposureError(ValueError):
    """Protected mode refused a listener: it would be reachable from the network with no authentication."""


def endpoint_host(endpoint: str) -> str | None:
    """The host a ``tcp://host:port`` endpoint binds (``[::1]`` as ``::1``); None for ipc/inproc, which no
    other host can reach."""
    if not endpoint.startswith("tcp://"):
        return None
    return endpoint[len("tcp://"):].rpartition(":")[0].strip("[]")


def is_loopback(host: str) -> bool:
    """True if a listener bound to ``host`` (an address, a host name, ZeroMQ's ``lo``, or ``*`` for every
    interface) is reachable from this host only."""
    host = host.strip("[]")
    if host in ("localhost", "lo"):
        return True
    if host in _ANY_HOST:
        return False
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        pass
    try:  # a host name: loopback only if every address it names is
        addresses = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False  # an interface name (eth0) or an unknown name: assume the network
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


_warned: set[tuple[str, str]] = set()


def check_exposure(host: str, what: str, *, authenticated: bool, insecure_network: bool,
                   fix: str = INSECURE_NETWORK_FIX) -> None:
    """Protected mode, the one rule for every listener: ``what`` (e.g. "--frontend tcp://*:5555") may listen
    on ``host`` if that is loopback, or if its process authenticates peers (CURVE), or if the user accepted
    an unauthenticated network listener (``insecure_network``: then one WARNING per listener and process).
    Otherwise ``ExposureError``, one line naming the fixes (``fix``: how this caller spells the override)."""
    if is_loopback(host) or authenticated:
        return
    where = "every interface" if host in _ANY_HOST else host
    if insecure_network:
        if (what, host) not in _warned:
            _warned.add((what, host))
            event(log, logging.WARNING, "security.insecure_network", listener=what, host=where,
                  risk="any host that reaches it is trusted: no authentication")
        return
    raise ExposureError(f"{what}: protected mode refuses to listen on {where} without authentication (any host "
                        f"that reaches it would be trusted). Bind 127.0.0.1, or give CURVE keys (`spec-serve "
                        f"keygen DIR` writes them and prints the flags), or pass {fix} to accept the risk")


@dataclasses.dataclass(frozen=True)
class KeySet:
    """One deployment's CURVE keys, as ``keygen_set`` writes them."""

    broker_key: Path  # public: workers and clients name it (--curve-server-key)
    broker_secret: Path
    worker_secret: Path
    client_secret: Path
    workers_dir: Path  # public keys the broker's backend, and clients' data sockets, admit
    clients_dir: Path  # public keys the broker's frontend admits


def keygen_set(directory: Path) -> KeySet:
    """Write a broker, a worker and a client keypair into ``directory``, and admit the worker's and the
    client's public keys (``workers/``, ``clients/``); refuses to overwrite keys already there."""
    names = ("broker", "worker", "client")
    existing = [directory / f"{n}{ext}" for n in names for ext in (".key", ".key_secret")
                if (directory / f"{n}{ext}").exists()]
    if existing:
        raise FileExistsError(f"{existing[0]} exists: keygen never replaces keys peers may already use; choose "
                              f"another directory, or add one key with --name NAME --authorize DIR")
    made = {name: keygen(directory, name) for name in names}
    admitted = {}
    for group, name in (("workers", "worker"), ("clients", "client")):
        admitted[group] = directory / group
        admitted[group].mkdir(exist_ok=True)
        shutil.copy(made[name][0], admitted[group])  # public keys only: a directory of admitted keys
    return KeySet(broker_key=made["broker"][0], broker_secret=made["broker"][1], worker_secret=made["worker"][1],
                  client_secret=made["client"][1], workers_dir=admitted["workers"], clients_dir=admitted["clients"])


def route_address(broker_url: str) -> str:
    """The local address peers can reach us at: the interface that routes to the broker
    (a client's data socket, a reply path's rendezvous)."""
    host = urlsplit(broker_url).hostname or "127.0.0.1"
    if host in ("localhost", "*"):
        return "127.0.0.1"
    try:
        if ipaddress.ip_address(host).is_loopback:
            return "127.0.0.1"
    except ValueError:
        pass
    family, _, _, _, where = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    probe = socket.socket(family, socket.SOCK_DGRAM)
    try:
        probe.connect(where)  # UDP connect sends nothing
        address: str = probe.getsockname()[0]
        return address
    finally:
        probe.close()


def tcp_endpoint(host: str, port: int | str) -> str:
    """``tcp://host:port``, an IPv6 address in brackets."""
    return f"tcp://[{host}]:{port}" if ":" in host and not host.startswith("[") else f"tcp://{host}:{port}"


@functools.cache
def local_host_key() -> str:
    """Who shares our host closely enough to share memory (a reply path that lends it): same kernel boot, and the same
    network, mount and pid namespaces.

    Peers with equal keys see the same /dev/shm and the same pids, so a worker can map what a client
    names, and tell from /proc whether that client's process still lives. The hostname stands in
    where /proc is absent.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        inodes = [os.stat(f"/proc/self/ns/{ns}").st_ino for ns in ("net", "mnt", "pid")]
        return ":".join([boot, *map(str, inodes)])
    except OSError:
        return socket.gethostname()


def check_connect_url(url: object, expect: str, default_port: int) -> str:
    """``url`` if a socket can connect to it (``tcp://host:port``, ``ipc://path``, ``inproc://name``);
    else a ``ValueError`` with the likely fix. ``expect`` says what should listen there, e.g.
    "the broker's client port, its --frontend (default 5555)"."""
    url = _check_url(url, expect, default_port, host_example="BROKER")
    if url.startswith("tcp://") and "*" in url[6:]:
        raise ValueError(f"{url!r}: '*' is for binding; connect to the broker's host name or address, "
                         f"e.g. tcp://BROKER:{default_port}; expected {expect}")
    return url


def check_bind_url(url: object, expect: str, default_port: int) -> str:
    """``url`` if a socket can bind it (``tcp://*:port``, ``tcp://host:port``, ``ipc://path``), else a
    ``ValueError`` with the likely fix."""
    return _check_url(url, expect, default_port, host_example="*")


def _check_url(url: object, expect: str, default_port: int, host_example: str) -> str:
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"expected a ZeroMQ endpoint such as tcp://{host_example}:{default_port}, got {url!r}; "
                         f"expected {expect}")
    scheme, sep, rest = url.partition("://")
    if not sep:
        host, colon, port = url.rpartition(":")
        if url.isdigit():
            fix = f"tcp://{host_example}:{url}"
        else:
            fix = f"tcp://{url}" if colon and port.isdigit() and host else f"tcp://{url}:{default_port}"
        raise ValueError(f"{url!r} has no scheme: did you mean {fix}? Expected {expect}")
    if scheme in ("http", "https"):
        host = urlsplit(url).hostname or host_example
        raise ValueError(f"{url!r} is an HTTP URL, but spec-serve peers talk ZeroMQ: use tcp://{host}:{default_port}, "
                         f"{expect}; the broker's HTTP port serves only /health, /model_info, /workers, /metrics")
    if scheme in ("ipc", "inproc"):
        if not rest:
            raise ValueError(f"{url!r} names no {scheme} path")
        return url
    if scheme != "tcp":
        raise ValueError(f"{url!r}: unsupported scheme {scheme!r}; use tcp://{host_example}:{default_port}, {expect}")
    host, colon, port = rest.rpartition(":")
    _check_ipv6(url, host, rest, default_port)
    if not colon or not host or not (port.isdigit() and 0 < int(port) < 65536 or port == "*"):
        raise ValueError(f"{url!r} needs a host and a port, e.g. tcp://{host or rest or host_example}:"
                         f"{default_port}; expected {expect}")
    return url


def _check_ipv6(url: str, host: str, rest: str, default_port: int) -> None:
    """An IPv6 address goes in brackets, port after: ``tcp://[::1]:5555``; else a ValueError saying so."""
    if rest.startswith("["):
        inside, bracket, _ = rest[1:].partition("]")
        try:
            ipaddress.IPv6Address(inside.split("%")[0])
            valid = bool(bracket)
        except ValueError:
            valid = False
        if not valid:
            raise ValueError(f"{url!r}: brackets hold an IPv6 address, e.g. tcp://[::1]:{default_port}")
        if not rest[1:].partition("]")[2].startswith(":"):
            raise ValueError(f"{url!r} needs a port after the IPv6 address, e.g. tcp://[{inside}]:{default_port}")
    elif ":" in host:
        address = rest if rest.count(":") > 1 and not rest.rpartition(":")[2].isdigit() else host
        raise ValueError(f"{url!r}: an IPv6 address goes in brackets, before the port: "
                         f"tcp://[{address}]:{default_port if address == rest else rest.rpartition(':')[2]}")


# LO-HI: free_port picks from this range instead of the OS's ephemeral ports. Parallel runs on one host (the
# test suite's processes) each given a range of their own never pick a port another has picked and not yet
# bound, nor one the OS hands out meanwhile for an outgoing connection.
PORT_RANGE_ENV = "SPEC_SERVE_PORT_RANGE"
_port_cursor: dict[tuple[int, int], int] = {}  # per range: where this process's next pick starts


def _port_range() -> tuple[int, int] | None:
    text = os.environ.get(PORT_RANGE_ENV, "").strip()
    if not text:
        return None
    try:
        lo, hi = (int(part) for part in text.split("-"))
    except ValueError:
        lo = hi = 0
    if not 0 < lo <= hi < 65536:
        raise ValueError(f"{PORT_RANGE_ENV}={text!r} is not a range of TCP ports: give LO-HI, e.g. 20000-20999")
    return lo, hi


def address_family(host: str) -> socket.AddressFamily:
    """The socket family of ``host`` (an IPv6 address, bracketed or not: AF_INET6; else AF_INET)."""
    return socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET


def _bindable(host: str, port: int) -> bool:
    with socket.socket(address_family(host)) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on now: the OS picks it, or under PORT_RANGE_ENV the next
    bindable one of that range, from a random start in each process (so a process and its children rarely
    try the same one)."""
    host = host.strip("[]")
    span = _port_range()
    if span is None:
        with socket.socket(address_family(host)) as s:
            s.bind((host, 0))
            port: int = s.getsockname()[1]
            return port
    lo, hi = span
    size = hi - lo + 1
    start = _port_cursor.setdefault(span, lo + int.from_bytes(os.urandom(4), "little") % size)
    for step in range(size):
        port = lo + (start - lo + step) % size
        if _bindable(host, port):
            _port_cursor[span] = lo + (port - lo + 1) % size
            return port
    raise RuntimeError(f"no free TCP port on {host} in {PORT_RANGE_ENV}={lo}-{hi}: widen the range")
