"""CurveZMQ authentication, a loopback-only HTTP shim, and no pickle on any socket path.

With CURVE on, the broker admits only the public keys in its authorized
directory: an unauthenticated (or unknown-key) client gets no answer and an
unauthenticated worker never registers, while authenticated peers get results
torch.equal to the colocated forward. Replies travel worker -> client over a
CURVE connection too (the client's data socket is a CURVE server).
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest

from cluster_util import CLIENT_KW, FAST_ENV, Reference, same, wait_until, workers
from spec_serve.client import RemoteTargetModel
from spec_serve.launch import Cluster, free_port, local_cluster
from spec_serve.sockets import Security, keygen

PACKAGE = Path(__file__).resolve().parent.parent / "spec_serve"


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    root = tmp_path_factory.mktemp("curve")
    authorized = root / "authorized"
    authorized.mkdir()
    out = {}
    for name in ("broker", "worker", "client", "stranger"):
        out[name] = keygen(root / name, name)  # (public, secret)
    for name in ("worker", "client"):
        shutil.copy(out[name][0], authorized / f"{name}.key")
    out["authorized"] = authorized
    return out


@pytest.fixture(scope="module")
def cluster(tiny_target_dir, keys, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("security-logs")
    broker_args = ["--curve-secret-key", str(keys["broker"][1]), "--curve-authorized-dir", str(keys["authorized"])]
    worker_args = ["--curve-secret-key", str(keys["worker"][1]), "--curve-server-key", str(keys["broker"][0])]
    with local_cluster(tiny_target_dir, workers=1, broker_args=broker_args, worker_args=worker_args,
                       env=dict(FAST_ENV), log_dir=log_dir) as c:
        yield c


def test_authenticated_client_gets_correct_results(cluster, keys, tiny_target_dir, tiny_vocab_mapping):
    reference = Reference(tiny_target_dir, tiny_vocab_mapping)
    security = Security(keys["client"][1], server_key_file=keys["broker"][0])
    with RemoteTargetModel(cluster.frontend, security=security, timeout=30, **CLIENT_KW) as client:
        client.set_vocab_mapping(*tiny_vocab_mapping)
        got = [client.generate_batch(*reference.batch(seed)) for seed in range(3)]
        verified = sum(same(g, reference.expected(seed)) for seed, g in enumerate(got))
        verified += same(client.generate_batch(*reference.batch(7), kind="dspark"), reference.expected(7, kind="dspark"))
    print(f"\ncurve: authenticated client verified {verified}/4")
    assert verified == 4


@pytest.mark.parametrize("who", ["no CURVE", "unknown key", "wrong server key"])
def test_unauthenticated_client_is_refused(cluster, keys, who):
    security = {
        "no CURVE": None,
        "unknown key": Security(keys["stranger"][1], server_key_file=keys["broker"][0]),
        "wrong server key": Security(keys["client"][1], server_key_file=keys["stranger"][0]),
    }[who]
    client = RemoteTargetModel(cluster.frontend, security=security, timeout=3, max_retries=0, **CLIENT_KW)
    start = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            client.status()
    finally:
        client.close()
    print(f"\ncurve: client with {who}: no answer from the broker ({time.monotonic() - start:.1f}s timeout)")


def test_unauthenticated_worker_never_registers(cluster, keys, tiny_target_dir):
    before = len(workers(cluster))
    n = len(cluster.workers)
    cluster.start_worker(tiny_target_dir)  # no keys at all
    cluster.start_worker(tiny_target_dir, "--curve-secret-key", str(keys["stranger"][1]),
                         "--curve-server-key", str(keys["broker"][0]))
    logs = [cluster.log_dir / f"worker{i}.log" for i in (n, n + 1)]
    # Wait until both have loaded their model and sent READY, then give the broker time.
    wait_until(lambda: all(p.exists() and "worker.ready" in p.read_text(errors="replace") for p in logs),
               timeout=120, interval=0.5, what="the intruding workers sending READY")
    time.sleep(3.0)
    after = len(workers(cluster))
    print(f"\ncurve: workers registered before {before}, after two unauthenticated workers tried: {after}")
    assert after == before
    for proc in cluster.workers[n:]:
        proc.terminate()


def test_http_shim_binds_loopback_by_default(tiny_target_dir, tmp_path):
    c = Cluster(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", free_port(), env=dict(FAST_ENV))
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
