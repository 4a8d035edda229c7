"""Helpers for the fault, load and security tests: real broker and worker subprocesses.

Also test-only entry points, so these tests need no knob in the production worker:
``python tests/cluster_util.py slow-worker ...`` serves the hf engine with an artificial delay
before every forward, or dies (as a crashing engine would) on a forward whose tokens are all one
given id; ``swap-worker ...`` replaces its checkpoint in place after N forwards (a target reloaded
under a running worker, which the broker still knows by its registration);
``idle-client BROKER TARGET`` is a client process whose memory a test can measure
(tests/system/test_hostile.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

import zygote
from spec_serve.worker.forward_hold import HOLD_FORWARD_ENV

# Short timers for the subprocesses (read by spec_serve.protocol.commands at import).
# Liveness 5 x 0.2 s = 1 s: a worker is dead after about a second of silence.
HEARTBEAT_INTERVAL = 0.2
HEARTBEAT_LIVENESS = 5
FAST_ENV = {
    "SPEC_SERVE_HEARTBEAT_INTERVAL": str(HEARTBEAT_INTERVAL),
    "SPEC_SERVE_HEARTBEAT_LIVENESS": str(HEARTBEAT_LIVENESS),
    # Workers start slowly on a loaded CI box: don't answer UNKNOWN_SERVICE early.
    "SPEC_SERVE_UNKNOWN_SERVICE_GRACE": "120",
    "SPEC_SERVE_LOG_LEVEL": "INFO",
}
# Clients in the test process: same interval, a more forgiving broker-loss window
# (the test process runs many threads on two shared cores).
CLIENT_KW = {"heartbeat_interval": HEARTBEAT_INTERVAL, "liveness": 15}
HERE = Path(__file__).resolve().parent
# Forgiving liveness for tests that count retries (dead after 3 s of silence, not 1 s): on 2 loaded
# cores a slow heartbeat must not look like a dead peer and add an attempt of its own.
FORGIVING_ENV = {**FAST_ENV, "SPEC_SERVE_HEARTBEAT_LIVENESS": "15"}
FORGIVING_CLIENT_KW = {"timeout": 60, "heartbeat_interval": HEARTBEAT_INTERVAL, "liveness": 15}


def network_address() -> str | None:
    """An IPv4 address of one of this host's interfaces other than loopback (other hosts could reach a
    listener there), or None on a host with loopback only. Protected-mode tests bind it."""
    import fcntl
    import ipaddress

    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:  # SIOCGIFADDR: the interface's IPv4 address
                packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue  # no IPv4 address, or down
        address = socket.inet_ntoa(packed[20:24])
        if not ipaddress.ip_address(address).is_loopback:
            return address
    return None


def rss_kib(pid: int) -> int:
    """Resident set size of a process in KiB, from /proc."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def listening_addresses(pid: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp writes them: 0100007F = 127.0.0.1) of a process's listening
    TCP sockets."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    out = set()
    for table in ("tcp", "tcp6"):
        for line in open(f"/proc/{pid}/net/{table}").read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                out.add(fields[1].rsplit(":", 1)[0])
    return out


def peak_rss_kib(pid: int) -> int:
    """Peak resident set size of a process in KiB (VmHWM), since start or ``reset_peak_rss``."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmHWM for {pid}")


def reset_peak_rss(pid: int) -> None:
    """Start VmHWM afresh from the current RSS (Linux clear_refs)."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


class RawZmtpPeer:
    """A hand-rolled ZMTP 3.0 peer (NULL mechanism) on a plain TCP socket.

    It sends what libzmq's API never would: frames of a message that never ends (libzmq itself
    holds a multipart message back until its last frame is queued).
    """

    def __init__(self, endpoint: str, socket_type: bytes = b"DEALER"):
        host, port = endpoint[len("tcp://"):].rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.sock.sendall(b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32))
        got = b""
        while len(got) < 64:
            chunk = self.sock.recv(64 - len(got))
            if not chunk:
                raise ConnectionError("peer closed during the ZMTP greeting")
            got += chunk
        ready = b"\x05READY\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
        self.sock.sendall(self.frame(ready, command=True))

    @staticmethod
    def frame(body: bytes, more: bool = False, command: bool = False) -> bytes:
        flags = (1 if more else 0) | (4 if command else 0)
        if len(body) > 255:
            return bytes([flags | 2]) + struct.pack(">Q", len(body)) + body
        return bytes([flags, len(body)]) + body

    def flood(self, first_frames: list[bytes], total: int, chunk: int = 1 << 20,
              timeout: float = 60.0) -> tuple[int, bool]:
        """Send ``first_frames``, then ``chunk``-byte frames, all marked MORE, up to ``total`` bytes: a message
        that never ends. Returns the bytes sent, and whether the receiver cut the connection (a reset, a
        broken pipe, or end of stream): a receiver that merely stops reading (a send that times out) or
        takes it all did not."""
        frame = self.frame(bytes(chunk), more=True)
        sent, deadline = 0, time.monotonic() + timeout
        try:
            for f in first_frames:
                self.sock.sendall(self.frame(f, more=True))
            while sent < total and time.monotonic() < deadline:
                self.sock.sendall(frame)
                sent += chunk
        except TimeoutError:  # the receiver stopped reading: cut only if it also closed the connection
            return sent, self._closed_by_peer()
        except OSError:  # broken pipe, reset: the receiver shut the connection
            return sent, True
        return sent, self._closed_by_peer()

    def _closed_by_peer(self, wait: float = 2.0) -> bool:
        """End of stream (or a reset) within ``wait`` seconds; a peer that only keeps quiet is still there."""
        self.sock.settimeout(wait)
        try:
            while True:
                if not self.sock.recv(65536):
                    return True
        except TimeoutError:
            return False
        except OSError:
            return True

    def send(self, frames: list[bytes]) -> None:
        """One whole message."""
        self.sock.sendall(b"".join(self.frame(f, more=i < len(frames) - 1) for i, f in enumerate(frames)))

    def slow_frames(self, first_frames: list[bytes], per_step: int, step_s: float, timeout: float) -> bool:
        """``first_frames``, then empty frames, ``per_step`` every ``step_s``, never ending the message, until the
        receiver cuts the connection (True) or ``timeout`` passes (False)."""
        chunk, deadline = self.frame(b"", more=True) * per_step, time.monotonic() + timeout
        try:
            for f in first_frames:
                self.sock.sendall(self.frame(f, more=True))
            while time.monotonic() < deadline:
                self.sock.sendall(chunk)
                time.sleep(step_s)
        except OSError:
            return True
        return False

    def messages(self, timeout: float) -> list[list[bytes]]:
        """The messages the receiver sent us (ZMTP commands skipped) until it closed the connection or
        ``timeout`` passed."""
        data, deadline = b"", time.monotonic() + timeout
        self.sock.settimeout(0.1)
        while time.monotonic() < deadline:
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not chunk:
                break
            data += chunk
        messages, current, at = [], [], 0
        while at + 2 <= len(data):
            flags = data[at]
            size_len = 8 if flags & 2 else 1
            if at + 1 + size_len > len(data):
                break
            size = int.from_bytes(data[at + 1:at + 1 + size_len], "big")
            body, at = data[at + 1 + size_len:at + 1 + size_len + size], at + 1 + size_len + size
            if flags & 4:
                continue  # a command (READY, PING)
            current.append(body)
            if not flags & 1:
                messages.append(current)
                current = []
        return messages

    def many_frames(self, first_frames: list[bytes], count: int, timeout: float = 60.0) -> int:
        """One whole message: ``first_frames``, then ``count`` empty frames (2 bytes each on the wire), the
        last ending it. Returns the bytes sent before the receiver cut the connection (all if never)."""
        chunk, sent, deadline = self.frame(b"", more=True) * 65536, 0, time.monotonic() + timeout
        try:
            for f in first_frames:
                self.sock.sendall(self.frame(f, more=True))
            left = count - 1
            while left > 0 and time.monotonic() < deadline:
                n = min(left, 65536)
                self.sock.sendall(chunk[:2 * n])
                sent, left = sent + 2 * n, left - n
            self.sock.sendall(self.frame(b""))
            return sent + 2
        except OSError:  # the receiver shut the connection
            return sent

    def close(self) -> None:
        self.sock.close()


def workers(cluster, service: str | None = None) -> list[dict]:
    _, body = cluster.get("/workers")
    return [w for w in body["workers"] if service is None or w["service"] == service]


@contextlib.contextmanager
def captured_log(logger_name: str):
    """Lines logged to ``logger_name`` (INFO and up) while inside, whatever its handlers."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def stall_replies(client) -> threading.Event:
    """While the returned event is set, ``client``'s I/O thread reads no reply (it still heartbeats)."""
    stalled = threading.Event()
    sockets = client._io.sockets
    drain = sockets.drain

    def drain_unless_stalled(sock, handler):
        if sock is sockets.data and stalled.is_set():
            time.sleep(0.01)  # the socket stays readable: do not spin
            return
        drain(sock, handler)

    sockets.drain = drain_unless_stalled
    return stalled


def wait_until(predicate, timeout: float, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"{what} not reached within {timeout:g}s (last: {value!r})")


class Gate:
    """A file that held forwards wait for: a worker started with ``gate.env`` holds each generate forward it
    begins (logging ``worker.test_hold``) until the test calls ``open`` (SPEC_SERVE_TEST_HOLD_FORWARD).
    So "the forward still runs" is a fact the test controls, not a guess about how long it takes."""

    def __init__(self, path: Path):
        self.path = path

    @property
    def env(self) -> dict[str, str]:
        return {HOLD_FORWARD_ENV: str(self.path)}

    def open(self) -> None:
        self.path.touch()


def start_slow_worker(cluster, target, delay: float, *extra: str, env: dict | None = None) -> subprocess.Popen:
    """A worker whose every forward first sleeps ``delay`` seconds (test-only entry point); ``env`` adds to
    the cluster's environment (e.g. a ``Gate``'s)."""
    return _start_test_worker(cluster, target, "--delay", str(delay), *extra, env=env)


def start_nan_worker(cluster, target, token: int, *extra: str) -> subprocess.Popen:
    """A worker whose forward on input ids all ``token`` answers a NaN in its first hidden state (as a broken
    target would), and every other forward as the engine computes it."""
    return _start_test_worker(cluster, target, "--delay", "0", "--nan-on-token", str(token), *extra)


def start_crashing_worker(cluster, target, token: int, *extra: str) -> subprocess.Popen:
    """A worker whose process dies at once on a forward whose input ids are all ``token``."""
    return _start_test_worker(cluster, target, "--delay", "0", "--crash-on-token", str(token), *extra)


def _start_test_worker(cluster, target, *args: str, env: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, **cluster.env, **(env or {})}
    out = subprocess.DEVNULL
    if cluster.log_dir is not None:
        cluster.log_dir.mkdir(parents=True, exist_ok=True)
        out = open(cluster.log_dir / f"slow-worker{len(cluster.workers)}.log", "ab")
    proc = zygote.popen([str(HERE / "cluster_util.py"), "slow-worker", *args, "--target", str(target),
                         "--broker", cluster.backend], env, out)
    cluster.workers.append(proc)
    return proc


def start_swap_worker(cluster, target, swap_to, after: int, service: str) -> subprocess.Popen:
    """A worker that serves ``target`` for ``after`` forwards, then ``swap_to`` (test-only entry point)."""
    env = {**os.environ, **cluster.env}
    out = subprocess.DEVNULL
    if cluster.log_dir is not None:
        cluster.log_dir.mkdir(parents=True, exist_ok=True)
        out = open(cluster.log_dir / f"swap-worker{len(cluster.workers)}.log", "ab")
    proc = zygote.popen([str(HERE / "cluster_util.py"), "swap-worker", "--target", str(target), "--swap-to",
                         str(swap_to), "--after", str(after), "--broker", cluster.backend, "--service", service],
                        env, out)
    cluster.workers.append(proc)
    return proc


def hold_plane_copies(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """From now on, clients in this process map same-host replies but wait before copying them out (so the
    worker's slot stays lent): returns (copying, go_on), set when a copy starts and to let copies proceed."""
    from spec_serve.paths.plane import samehost

    copying, go_on = threading.Event(), threading.Event()
    copy_into = samehost._Span.copy_into

    def held_copy(span, out):
        copying.set()
        go_on.wait(60)
        return copy_into(span, out)

    monkeypatch.setattr(samehost._Span, "copy_into", held_copy)
    return copying, go_on


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait()


class Reference:
    """Colocated ``HFTarget`` outputs for test batches, computed once per batch."""

    def __init__(self, target_dir, mapping):
        from spec_serve.engines.hf import HFTarget

        self.target_dir = target_dir
        self.engine = HFTarget(target_dir)
        self.engine.set_vocab_mapping(*mapping)
        self._cache: dict = {}
        self._lock = threading.Lock()

    def batch(self, seed: int, batch: int = 2, seq: int = 16):
        from spec_serve.tools.tiny import sample_batch

        return sample_batch(self.target_dir, batch, seq, seed=seed)

    def expected(self, seed: int, batch: int = 2, seq: int = 16, kind: str = "eagle3", shards: int = 1) -> dict:
        """The colocated answer as a client with ``shards`` shards receives it: each shard's rows computed
        by themselves (the contract's exact part; see ``assert_contract``)."""
        from spec_serve.tools.verify import colocated_reference

        key = (seed, batch, seq, kind, shards)
        with self._lock:
            if key not in self._cache:
                self._cache[key] = colocated_reference(self.engine, self.batch(seed, batch, seq), kind,
                                                       shards=shards)
            return self._cache[key]


def assert_contract(got: dict, engine, inputs, kind: str = "eagle3", shards: int = 1, **kw):
    """The contract (docs/equality.md) for a batch a client with ``shards`` shards got: each shard bit-equal
    (``torch.equal``) to ``engine``'s colocated forward of the same rows in the same composition; the
    assembled batch bit-equal to the unsharded forward where this machine's kernels are batch-invariant for
    the two compositions (measured: both are computed colocated), else within the derived tolerance.
    ``kw``: compact, device, selected (``spec_serve.tools.verify.check_contract``). Returns the check."""
    from spec_serve.tools.verify import check_contract

    check = check_contract(got, engine, tuple(inputs), kind, shards=shards, **kw)
    assert check.ok, check.describe()
    return check


def assert_equal_batches(got: dict, want: dict) -> None:
    """Same names, dtypes, shapes, and bit-equal values (``torch.equal``) as the colocated batch of the same
    composition (for a sharded batch, ``assert_contract``)."""
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert torch.equal(got[name].cpu(), want[name].cpu()), f"{name} differs from the colocated forward"


def same(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


class Tally:
    """Counts a fault test prints: sent, completed, verified, wrong, failed."""

    def __init__(self):
        self.sent = self.completed = self.verified = self.wrong = self.failed = 0
        self.errors: list[str] = []
        self._lock = threading.Lock()

    def add(self, **counts):
        with self._lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    def error(self, e: BaseException):
        with self._lock:
            self.failed += 1
            self.errors.append(f"{type(e).__name__}: {e}")

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("sent", "completed", "verified", "wrong", "failed")}


def run_requests(client, reference: Reference, seeds, tally: Tally, kind: str = "eagle3", batch: int = 2,
                 seq: int = 16) -> None:
    """Submit one batch per seed (prefetch as deep as the client allows) and verify each result."""
    futures = []
    for seed in seeds:
        futures.append((seed, client.generate_batch_async(*reference.batch(seed, batch, seq), kind=kind)))
        tally.add(sent=1)
    for seed, fut in futures:
        try:
            got = fut.result()
        except Exception as e:  # counted, reported by the test
            tally.error(e)
            continue
        tally.add(completed=1)
        if same(got, reference.expected(seed, batch, seq, kind)):
            tally.add(verified=1)
        else:
            tally.add(wrong=1)


# ------------------------------------------------------------ test-only worker


def _slow_worker_main(argv: list[str]) -> None:
    import argparse
    import logging

    from spec_serve.engines import load_engine
    from spec_serve.telemetry import logs
    from spec_serve.worker.drain import exit_if_computing, handle_stop_signals
    from spec_serve.worker.server import Worker

    p = argparse.ArgumentParser(prog="cluster_util.py slow-worker")
    p.add_argument("--delay", type=float, required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--broker", required=True)
    p.add_argument("--service", default="default")
    p.add_argument("--crash-on-token", type=int, default=None)
    p.add_argument("--nan-on-token", type=int, default=None)
    p.add_argument("--capacity", type=int, default=2)
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    logs.setup(os.environ.get("SPEC_SERVE_LOG_LEVEL", "INFO"))
    engine = load_engine("hf", args.target, device=args.device)
    inner = engine.generate_batch
    log = logging.getLogger("spec_serve.worker")

    def slow_generate_batch(input_ids, *a, **kw):
        if args.crash_on_token is not None and bool((input_ids == args.crash_on_token).all()):
            os._exit(70)  # as a segfault or an OOM kill would: no reply, no DONE, no goodbye
        log.info("test.forward_started rows=%d", input_ids.shape[0])
        time.sleep(args.delay)  # holds the compute thread only; heartbeats run on the I/O thread
        out = inner(input_ids, *a, **kw)
        if args.nan_on_token is not None and bool((input_ids == args.nan_on_token).all()):
            out = dict(out)
            name = next(n for n in out if n.endswith("hidden_states"))
            out[name] = out[name].clone()
            out[name][0, 0, 0] = float("nan")
        return out

    engine.generate_batch = slow_generate_batch
    worker = Worker(engine, args.broker, service=args.service, capacity=args.capacity,
                    drain_timeout=args.drain_timeout)
    handle_stop_signals(worker)  # as `spec-serve worker` does: SIGTERM drains, a second one stops at once
    worker.run()
    exit_if_computing(worker.compute, worker.paths)


def _swap_worker_main(argv: list[str]) -> None:
    import argparse

    from spec_serve.engines import load_engine
    from spec_serve.telemetry import logs
    from spec_serve.worker.drain import exit_if_computing
    from spec_serve.worker.server import Worker

    p = argparse.ArgumentParser(prog="cluster_util.py swap-worker")
    p.add_argument("--target", required=True)
    p.add_argument("--swap-to", required=True)
    p.add_argument("--after", type=int, required=True)
    p.add_argument("--broker", required=True)
    p.add_argument("--service", default="default")
    args = p.parse_args(argv)
    logs.setup(os.environ.get("SPEC_SERVE_LOG_LEVEL", "INFO"))
    engine, other = load_engine("hf", args.target), load_engine("hf", args.swap_to)
    worker = Worker(engine, args.broker, service=args.service)
    inner, calls = engine.generate_batch, [0]

    def generate_batch(*a, **kw):
        calls[0] += 1
        if calls[0] <= args.after:
            return inner(*a, **kw)
        mapping = engine.vocab_mapping()
        if mapping is not None:
            other.set_vocab_mapping(*mapping)
        worker.engine = other  # from now on the worker serves (and reports) the other checkpoint
        return other.generate_batch(*a, **kw)

    engine.generate_batch = generate_batch
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    worker.run()
    exit_if_computing(worker.compute, worker.paths)


def _idle_client_main(argv: list[str]) -> None:
    """Print the data endpoint; on each stdin line run a dspark batch and print its stats; exit at EOF."""
    from spec_serve.client.api import RemoteTargetModel
    from spec_serve.tools.tiny import sample_batch

    broker, target = argv
    with RemoteTargetModel(broker, timeout=30, **CLIENT_KW) as client:
        print(json.dumps({"data": client._io.data_endpoint}), flush=True)
        for _ in sys.stdin:
            out = client.generate_batch(*sample_batch(target, 2, 16, seed=1), kind="dspark")
            print(json.dumps({"shape": list(out["target_hidden_states"].shape),
                              "dropped": client._io.sockets.data_ingress.dropped, **vars(client.stats)}), flush=True)


def _holding_client_main(argv: list[str]) -> None:
    """A client that takes ``--requests`` DSpark replies through the same-host plane and never copies them
    out (so never gives their slots back); prints "holding" once it blocks, then waits to be killed."""
    import argparse

    from spec_serve.client.api import RemoteTargetModel
    from spec_serve.paths.plane import samehost
    from spec_serve.tools.tiny import sample_batch

    p = argparse.ArgumentParser(prog="cluster_util.py holding-client")
    p.add_argument("--broker", required=True)
    p.add_argument("--service", default="default")
    p.add_argument("--target", required=True)
    p.add_argument("--requests", type=int, default=2)
    args = p.parse_args(argv)
    threading.Timer(120, os._exit, (3,)).start()  # never outlive a test that forgot us

    def hold(span, out):
        print("holding", flush=True)
        threading.Event().wait()

    samehost._Span.copy_into = hold
    client = RemoteTargetModel(args.broker, service=args.service, timeout=600, prefetch_depth=args.requests,
                               **CLIENT_KW)
    for seed in range(args.requests):
        client.generate_batch_async(*sample_batch(args.target, 2, 16, seed=seed), kind="dspark")
    threading.Event().wait()


if __name__ == "__main__":
    entries = {"slow-worker": _slow_worker_main, "swap-worker": _swap_worker_main,
               "idle-client": _idle_client_main, "holding-client": _holding_client_main}
    entry = entries.get(sys.argv[1] if len(sys.argv) > 1 else "")
    if entry is None:
        sys.exit("usage: cluster_util.py slow-worker --delay S --target DIR --broker URL\n"
                 "       cluster_util.py swap-worker --target DIR --swap-to DIR --after N --broker URL\n"
                 "       cluster_util.py idle-client BROKER TARGET\n"
                 "       cluster_util.py holding-client --broker URL --target DIR [--requests N]")
    entry(sys.argv[2:])
