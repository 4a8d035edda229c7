"""CurveZMQ authentication, a loopback-only HTTP shim, and no pickle on any socket path.

With CURVE on, the broker's frontend admits only the client keys and its backend only the
worker keys (separate directories): an unauthenticated (or unknown-key) client gets no
answer and a worker without a worker key never registers, while authenticated peers get
results torch.equal to the colocated forward. Replies travel worker -> client over CURVE
too: the client's data socket is a CURVE server that admits only the workers' keys. Every
CURVE server socket has its own ZAP policy, whatever else shares its ZeroMQ context.
"""

from __future__ import annotations

import contextlib
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import zmq
from click.testing import CliRunner

from cluster_util import (
    CLIENT_KW,
    FAST_ENV,
    Reference,
    listening_addresses,
    network_address,
    same,
    wait_until,
    workers,
)
from spec_serve.broker.server import Broker
from spec_serve.client.api import BrokerUnreachable, RemoteTargetModel
from spec_serve.protocol.commands import CLIENT_TAG, ClientCommand, Status, control, data_message
from spec_serve.tools.cli import main
from spec_serve.tools.launch import Cluster, free_port
from spec_serve.transport.sockets import ExposureError, Security, check_exposure, is_loopback, keygen, make_socket

PACKAGE = Path(__file__).resolve().parents[2] / "spec_serve"


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """The set `spec-serve keygen DIR` writes, with the flags it prints; plus a stranger's keypair.
    Keypairs (public, secret) by name; "clients" and "workers": the public keys the broker admits."""
    root = tmp_path_factory.mktemp("curve") / "keys"
    printed = CliRunner().invoke(main, ["keygen", str(root)])
    assert printed.exit_code == 0, printed.output
    out = {name: (root / f"{name}.key", root / f"{name}.key_secret") for name in ("broker", "worker", "client")}
    out["stranger"] = keygen(root.parent / "stranger", "stranger")
    out["clients"], out["workers"] = root / "clients", root / "workers"
    out["printed"] = printed.output
    return out


def printed_flags(keys, command: str) -> list[str]:
    """The flags `spec-serve keygen` printed for ``command`` (broker, worker, status), without the
    placeholders a user fills in (--target MODEL, --broker tcp://BROKER:PORT)."""
    (line,) = [ln for ln in keys["printed"].splitlines() if ln.strip().startswith(f"spec-serve {command} ")]
    words = shlex.split(line)[2:]
    return [w for i, w in enumerate(words) if "BROKER" not in w and "MODEL" not in w
            and not (i + 1 < len(words) and ("BROKER" in words[i + 1] or "MODEL" in words[i + 1]))]


def client_security(keys, name="client", server="broker") -> Security:
    return Security(keys[name][1], server_key_file=keys[server][0], worker_keys_dir=keys["workers"])


# A non-loopback address of this host (other hosts could connect there); every interface without one.
NETWORK = network_address() or "0.0.0.0"


@pytest.fixture(scope="module")
def cluster(tiny_target_dir, keys, tmp_path_factory):
    """A CURVE broker listening beyond loopback (allowed without --insecure-network: CURVE admits only its
    keys) and one worker, both started with exactly the flags `spec-serve keygen` printed."""
    log_dir = tmp_path_factory.mktemp("security-logs")
    c = Cluster.on_free_ports(NETWORK, env=dict(FAST_ENV), log_dir=log_dir)
    try:
        c.start_broker(*printed_flags(keys, "broker"))
        c.start_worker(tiny_target_dir, *printed_flags(keys, "worker"))
        c.wait_workers(1)
        yield c
    finally:
        c.stop()


def test_authenticated_client_gets_correct_results(cluster, keys, tiny_target_dir, tiny_vocab_mapping):
    reference = Reference(tiny_target_dir, tiny_vocab_mapping)
    with RemoteTargetModel(cluster.frontend, security=client_security(keys), timeout=30, **CLIENT_KW) as client:
        client.set_vocab_mapping(*tiny_vocab_mapping)
        got = [client.generate_batch(*reference.batch(seed)) for seed in range(3)]
        verified = sum(same(g, reference.expected(seed)) for seed, g in enumerate(got))
        dspark = client.generate_batch(*reference.batch(7), kind="dspark")
        verified += same(dspark, reference.expected(7, kind="dspark"))
    print(f"\ncurve: authenticated client verified {verified}/4")
    assert verified == 4


@pytest.mark.parametrize("who", ["no CURVE", "unknown key", "wrong server key", "a worker's key"])
def test_unauthenticated_client_is_refused(cluster, keys, who):
    security = {
        "no CURVE": None,
        "unknown key": client_security(keys, "stranger"),
        "wrong server key": client_security(keys, server="stranger"),
        "a worker's key": client_security(keys, "worker"),
    }[who]
    client = RemoteTargetModel(cluster.frontend, security=security, timeout=30, max_retries=0, connect_timeout=2,
                               **CLIENT_KW)
    start = time.monotonic()
    try:  # fails fast, naming the likely cause
        with pytest.raises(BrokerUnreachable, match="CURVE") as refused:
            client.status()
    finally:
        client.close()
    if who in ("unknown key", "a worker's key"):  # the broker's flag that would admit it, not a hidden one
        assert "--curve-client-keys-dir" in str(refused.value) and "authorized" not in str(refused.value)
    print(f"\ncurve: client with {who}: no answer from the broker ({time.monotonic() - start:.1f}s timeout)")


def test_unauthenticated_worker_never_registers(cluster, keys, tiny_target_dir):
    """No keys, an unknown key, or a key admitted on the frontend (a client's): none registers as a worker,
    so none can serve forged batches, nor create the service it names. Each learns so before loading its
    model (the handshake with the broker comes first) and exits with one line naming the cause."""
    before = len(workers(cluster))
    refusals = _curve_refusals(cluster)
    n = len(cluster.workers)
    cluster.start_worker(tiny_target_dir, service="intruder")  # no keys at all
    for name in ("stranger", "client"):
        cluster.start_worker(tiny_target_dir, "--curve-secret-key", str(keys[name][1]),
                             "--curve-server-key", str(keys["broker"][0]), service="intruder")
    logs = [cluster.log_dir / f"worker{i}.log" for i in (n, n + 1, n + 2)]
    assert [proc.wait(120) for proc in cluster.workers[n:]] == [1, 1, 1]
    after = len(workers(cluster))
    texts = [p.read_text(errors="replace") for p in logs]
    assert not any("worker.ready" in t or "worker.loading" in t for t in texts), texts  # never answered
    assert "handshake failed" in texts[0] and all("refused our CURVE credentials" in t for t in texts[1:]), texts
    assert all("--curve-worker-keys-dir" in t and "authorized" not in t for t in texts[1:]), texts
    # The broker counts both refused keys, and logs the refused peer once for its address and role.
    assert _curve_refusals(cluster)["worker"] >= refusals["worker"] + 2
    broker_log = (cluster.log_dir / "broker.log").read_text(errors="replace")
    lines = [ln for ln in broker_log.splitlines() if "broker.curve_refused" in ln and "role=worker" in ln
             and "keys-dir" in ln]  # the keyless worker's failed handshake has a line of its own
    assert len(lines) == 1 and f"peer={cluster.frontend[6:].rpartition(':')[0]}" in lines[0], lines
    assert "--curve-worker-keys-dir" in lines[0]
    print(f"\ncurve: workers registered before {before}, after three unadmitted workers tried: {after}")
    assert after == before and "intruder" not in cluster.get("/workers")[1]["services"]


def _curve_refusals(cluster, cause: str = "key") -> dict[str, float]:
    _, text = cluster.get("/metrics")
    return {role: sum(float(ln.split()[-1]) for ln in text.splitlines()
                      if ln.startswith("spec_serve_curve_refusals_total{") and f'role="{role}"' in ln
                      and f'cause="{cause}"' in ln)
            for role in ("client", "worker")}


def test_broker_start_line_says_curve_is_on(cluster):
    assert re.search(r"broker\.start .*curve=on", (cluster.log_dir / "broker.log").read_text(errors="replace"))


def test_refused_client_keys_are_counted_and_logged_once_per_peer(cluster, keys):
    """Three tries with a stranger's key from one address: each counted on /metrics, one line naming the
    peer's address, the role it tried and the flag that would admit it."""
    before, log = _curve_refusals(cluster), cluster.log_dir / "broker.log"
    logged = len(log.read_text(errors="replace"))
    for _ in range(3):
        client = RemoteTargetModel(cluster.frontend, security=client_security(keys, "stranger"), timeout=30,
                                   max_retries=0, connect_timeout=1, **CLIENT_KW)
        try:
            with pytest.raises(BrokerUnreachable):
                client.status()
        finally:
            client.close()
    wait_until(lambda: _curve_refusals(cluster)["client"] >= before["client"] + 3, 10, what="3 refusals counted")
    assert _curve_refusals(cluster)["worker"] == before["worker"]
    text = log.read_text(errors="replace")
    lines = [ln for ln in text.splitlines() if "broker.curve_refused" in ln and "role=client" in ln
             and "keys-dir" in ln]
    # Only this test's role: a stranger worker of an earlier test may still be retrying its handshake.
    new = [ln for ln in text[logged:].splitlines() if "broker.curve_refused" in ln and "role=client" in ln]
    assert lines and len(new) <= 1, lines  # earlier tests' refusals from this address may have opened the window
    assert f"peer={cluster.frontend[6:].rpartition(':')[0]}" in lines[-1] and "--curve-client-keys-dir" in lines[-1]


def test_failed_curve_handshakes_are_counted_and_logged(cluster, keys):
    """A client with another broker key, or with no CURVE at all, fails the handshake before any key is
    checked: the broker counts it (cause "handshake") and logs the peer's address and role."""
    before, log = _curve_refusals(cluster, "handshake"), cluster.log_dir / "broker.log"
    logged = len(log.read_text(errors="replace"))
    for security in (client_security(keys, server="stranger"), None):
        client = RemoteTargetModel(cluster.frontend, security=security, timeout=30, max_retries=0, connect_timeout=1,
                                   **CLIENT_KW)
        try:
            with pytest.raises(BrokerUnreachable):
                client.status()
        finally:
            client.close()
    wait_until(lambda: _curve_refusals(cluster, "handshake")["client"] >= before["client"] + 2, 30,
               what="2 failed handshakes counted")
    # Client lines only: a stranger worker of an earlier test may still be retrying its handshake, and its
    # own line (role=worker) can land after this test's.
    text = log.read_text(errors="replace")
    client_lines = [ln for ln in text.splitlines() if "broker.curve_refused" in ln and "handshake failed" in ln
                    and "role=client" in ln]
    assert client_lines and f"peer={cluster.frontend[6:].rpartition(':')[0]}" in client_lines[-1]
    assert len([ln for ln in text[logged:].splitlines() if "curve_refused" in ln and "handshake failed" in ln
                and "role=client" in ln]) <= 1


def test_data_socket_admits_only_worker_keys(cluster, keys):
    """A client's data socket takes replies from the workers' keys only: not from a key the broker admits
    on its frontend (a client's), not from an unknown key, not without CURVE."""
    ctx = zmq.Context.instance()
    with RemoteTargetModel(cluster.frontend, security=client_security(keys), timeout=10, **CLIENT_KW) as client:
        delivered = {}
        for who in ("no CURVE", "stranger", "client", "worker"):
            before = client.stats.unknown
            security = None if who == "no CURVE" else Security(keys[who][1])
            push = make_socket(ctx, zmq.PUSH, connect=client._io.data_endpoint, security=security,
                               curve_server_key=client._io.data_key.encode() if security else None)
            try:
                # The socket takes a message once its pipe to the data socket is up, which a loaded box may not
                # have done by the first send (zmq.Again); a socket never writable delivers nothing.
                delivered[who] = False
                if push.poll(3000, zmq.POLLOUT):
                    push.send_multipart(data_message(Status.OK, uuid.uuid4().bytes, {"worker": who}),
                                        flags=zmq.NOBLOCK)
                    with contextlib.suppress(TimeoutError):
                        delivered[who] = bool(wait_until(lambda before=before: client.stats.unknown > before, 3,
                                                         what="delivery"))
            finally:
                push.close(0)
    print(f"\ncurve: data socket delivered from {delivered}")
    assert delivered == {"no CURVE": False, "stranger": False, "client": False, "worker": True}


def test_each_curve_socket_has_its_own_policy(keys, tiny_target_dir):
    """A client's data socket (admitting workers) made first in a process must not lend its policy to a
    broker made later in the same ZeroMQ context: the broker still admits only its client keys."""
    with RemoteTargetModel(f"tcp://127.0.0.1:{free_port()}", security=client_security(keys), timeout=5):
        broker = Broker("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", security=Security(
            keys["broker"][1], client_keys_dir=keys["clients"], worker_keys_dir=keys["workers"]))
        thread = threading.Thread(target=broker.run, daemon=True)
        thread.start()
        try:
            answered = {who: _status_answered(broker.frontend_endpoint, keys, who) for who in ("worker", "client")}
        finally:
            broker.stop()
            thread.join(10)
    print(f"\ncurve: broker frontend answered {answered} (the worker key is admitted only by the data socket)")
    assert answered == {"worker": False, "client": True}


def _status_answered(endpoint: str, keys, who: str) -> bool:
    sock = make_socket(zmq.Context.instance(), zmq.DEALER, connect=endpoint,
                       security=Security(keys[who][1], server_key_file=keys["broker"][0]))
    # A key the broker does not admit never completes its handshake: the send may then wait for a connection
    # that never comes, which counts as not answered (it blocked forever before, when the refusal came first).
    sock.setsockopt(zmq.SNDTIMEO, 3000)
    try:
        sock.send_multipart(control(CLIENT_TAG, ClientCommand.STATUS.value, "default", uuid.uuid4().bytes))
        return bool(sock.poll(3000))
    except zmq.Again:
        return False
    finally:
        sock.close(0)


def test_nccl_binding_is_refused_with_curve(cluster, keys, tiny_target_dir, tiny_vocab_mapping):
    """The NCCL rendezvous (TCPStore, gloo/NCCL connections) is not authenticated: a CURVE client refuses
    enable_nccl at once, and a CURVE broker refuses a BIND before it takes a worker out of the pool (its
    workers would refuse it too). An authorized client that sends BIND anyway keeps no worker: the pool
    serves its ordinary requests (the old broker kept the worker bound to it after the worker refused, and
    they timed out)."""
    with pytest.raises(ValueError, match="CURVE"):
        RemoteTargetModel(cluster.frontend, security=client_security(keys), enable_nccl=True)
    reference = Reference(tiny_target_dir, tiny_vocab_mapping)
    with RemoteTargetModel(cluster.frontend, security=client_security(keys), timeout=20, max_retries=0,
                           **CLIENT_KW) as client:
        client.target_info()
        header = {"reply_to": client._io.data_endpoint, "data_key": client._io.data_key, "timeout": 10,
                  "device_type": "cpu"}
        future = client._io.submit(ClientCommand.BIND, "default", header, (), 10, max_retries=0)
        try:
            refused = str(future.result(30).header)  # the broker's BOUND ok=false
        except Exception as e:  # the worker's refusal (a broker that let the BIND through)
            refused = str(e)
        assert "runs CURVE" in refused
        assert not [w for w in workers(cluster) if w["state"] == "bound"]
        client.set_vocab_mapping(*tiny_vocab_mapping)
        assert same(client.generate_batch(*reference.batch(11)), reference.expected(11))
    print(f"\ncurve: a BIND to a CURVE broker: {refused}")


def test_one_key_directory_for_both_sockets_is_refused(tmp_path):
    result = CliRunner().invoke(main, ["broker", "--curve-secret-key", str(tmp_path / "b.key_secret"),
                                       "--curve-authorized-dir", str(tmp_path), "--http-port", "0"])
    print(f"\n{result.output.strip()}")
    assert result.exit_code == 2 and "--curve-client-keys-dir" in result.output


def test_http_shim_binds_loopback_by_default(tiny_target_dir, tmp_path):
    c = Cluster.on_free_ports(env=dict(FAST_ENV))
    try:
        c.start_broker()
        listening = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in Path(table).read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, port = local.split(":")
                if state == "0A" and int(port, 16) == c.http_port:  # LISTEN
                    listening.add(addr)
        print(f"\nhttp shim on port {c.http_port} listens on {listening} (0100007F = 127.0.0.1)")
        assert listening == {"0100007F"}
    finally:
        c.stop()


# ------------------------------------------------------------------ protected mode


def _listens_beyond_loopback(pid: int) -> set[str]:
    """Non-loopback listening addresses of a process (hex, as /proc/net/tcp writes them)."""
    return {a for a in listening_addresses(pid) if a not in ("0100007F", "00000000000000000000000001000000")}


def test_curve_broker_listens_beyond_loopback_and_the_printed_client_works(cluster, keys):
    """`spec-serve keygen` is a copy-paste: the cluster above runs its printed broker and worker flags,
    listening beyond loopback with no --insecure-network (CURVE admits only the keys), and the printed
    Python lines make a client that is served."""
    addresses = _listens_beyond_loopback(cluster.broker.pid)
    python = [ln.strip() for ln in keys["printed"].splitlines()
              if ln.strip().startswith(("from spec_serve", "RemoteTargetModel("))]
    frontend = cluster.frontend.rpartition(":")
    code = "\n".join(python).replace("tcp://BROKER:5555", cluster.frontend).replace(
        "RemoteTargetModel(", "client = RemoteTargetModel(", 1)
    scope: dict = {}
    exec(code, scope)  # the lines as printed, the broker's address filled in
    try:
        status = scope["client"].status()
    finally:
        scope["client"].close()
    log = (cluster.log_dir / "broker.log").read_text()
    print(f"\nkeygen's flags: broker listens on {addresses} ({frontend[0]}), {len(status['workers'])} worker(s); "
          f"client from the printed lines: {python[-1][:60]}...")
    assert addresses and len(status["workers"]) == 1
    assert "security.insecure_network" not in log


def _broker_args(front: str, back: str, http_host: str = "127.0.0.1", *extra: str) -> list[str]:
    return [sys.executable, "-m", "spec_serve.tools.cli", "broker", "--frontend", front, "--backend", back,
            "--http-host", http_host, "--http-port", str(free_port()), *extra]


@pytest.mark.parametrize("listener", ["--frontend tcp://*", "--backend on a network address", "--http-host 0.0.0.0",
                                      "a worker's --http-host on a network address"])
def test_protected_mode_refuses_a_network_bind_without_keys(listener, tiny_target_dir):
    """No CURVE keys: a bind other hosts could reach is refused at start, with one line naming the fixes."""
    front, back, http_host = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", "127.0.0.1"
    if listener.startswith("--frontend"):
        front = f"tcp://*:{free_port()}"
    elif listener.startswith("--backend"):
        back = f"tcp://{NETWORK}:{free_port()}"
    elif listener.startswith("--http-host"):
        http_host = "0.0.0.0"
    args = _broker_args(front, back, http_host)
    if listener.startswith("a worker's"):  # refused before the broker check and the model load
        args = [sys.executable, "-m", "spec_serve.tools.cli", "worker", "--target", str(tiny_target_dir), "--device",
                "cpu", "--broker", back, "--http-host", NETWORK, "--http-port", str(free_port())]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("Error:")]
    print(f"\n{listener}: exit {done.returncode}: {errors}")
    assert done.returncode == 2 and len(errors) == 1
    assert "protected mode" in errors[0] and "CURVE" in errors[0] and "--insecure-network" in errors[0]


def test_insecure_network_listens_beyond_loopback_with_a_warning(tmp_path):
    """--insecure-network: the broker listens on the network address, serves a client that reaches it
    there, and logs one WARNING per exposed listener at start."""
    c = Cluster.on_free_ports(NETWORK, env=dict(FAST_ENV), log_dir=tmp_path)
    try:
        c.start_broker("--insecure-network")
        with RemoteTargetModel(c.frontend, timeout=30, **CLIENT_KW) as client:
            status = client.status()
        addresses = _listens_beyond_loopback(c.broker.pid)
    finally:
        c.stop()
    warnings = [ln for ln in (tmp_path / "broker.log").read_text().splitlines() if "security.insecure_network" in ln]
    print(f"\n--insecure-network: listens on {addresses}; {len(warnings)} warnings: {warnings[0][-120:]}")
    assert addresses and status["workers"] == []
    assert len(warnings) == 2 and all("WARNING" in w for w in warnings)


def test_default_binds_follow_protected_mode(keys, tmp_path):
    """With no --frontend/--backend the broker takes the default ports on loopback only; with CURVE keys on
    every interface (what the README's multi-host commands rely on)."""
    for port in (5555, 5556):
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                pytest.skip(f"port {port} is in use here")
    seen = {}
    for mode, extra in (("no keys", []), ("CURVE", printed_flags(keys, "broker"))):
        proc = subprocess.Popen([sys.executable, "-m", "spec_serve.tools.cli", "broker", "--http-port", "0", *extra],
                                stderr=subprocess.PIPE, text=True)
        try:
            banner = proc.stderr.readline()  # "broker: clients ..., workers ..." once bound
            seen[mode] = (banner.strip(), listening_addresses(proc.pid))
        finally:
            proc.terminate()
            proc.wait(30)
    print(f"\ndefault binds: {seen}")
    assert seen["no keys"][1] == {"0100007F"} and "this host only" in seen["no keys"][0]
    assert seen["CURVE"][1] in ({"00000000"}, {"0" * 32})  # every interface: IPv4, or IPv6 and IPv4 both


@pytest.mark.parametrize("host,loopback", [
    ("127.0.0.1", True), ("127.0.0.5", True), ("::1", True), ("[::1]", True), ("localhost", True), ("lo", True),
    ("*", False), ("0.0.0.0", False), ("::", False), ("", False), ("eth0", False), ("192.0.2.2", False),
    ("fd00::2", False),
])
def test_exposure_check_knows_loopback(host, loopback):
    """The one check every listener uses (broker ports, HTTP shims, the NCCL rendezvous)."""
    assert is_loopback(host) is loopback
    check_exposure(host, "x", authenticated=True, insecure_network=False)  # CURVE: always allowed
    if loopback:
        check_exposure(host, "x", authenticated=False, insecure_network=False)
    else:
        with pytest.raises(ExposureError, match="protected mode"):
            check_exposure(host, "x", authenticated=False, insecure_network=False)


def test_no_pickle_on_any_socket_path():
    """Nothing in the package can unpickle socket bytes: no pickle, no *_pyobj, no bare torch.load."""
    pattern = re.compile(r"\bpickle\b|recv_pyobj|send_pyobj|\bmarshal\b|torch\.load\(|\bdill\b|cloudpickle")
    hits = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if pattern.search(code) and "without pickle" not in code and "no pickle" not in code.lower():
                hits.append(f"{path.relative_to(PACKAGE.parent)}:{lineno}: {line.strip()}")
    print(f"\npickle scan: {len(list(PACKAGE.rglob('*.py')))} files, {len(hits)} hits")
    assert not hits, "\n".join(hits)
