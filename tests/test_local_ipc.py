"""Same-host replies over ipc: a client on a tcp broker also binds its data socket to an ipc endpoint
(``reply_local``), and a worker with the same host key replies there instead of over tcp loopback.

The cluster tests use real broker and worker processes; results are ``torch.equal`` to the colocated
target. That a reply came over ipc is proven, not just reported: the tcp endpoint is unbound first.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import zmq
from cluster_util import assert_equal_batches

from spec_serve.client import RemoteTargetModel
from spec_serve.launch import free_port, local_cluster
from spec_serve.protocol import Status, data_message
from spec_serve.sockets import Security, keygen, local_host_key, make_socket
from spec_serve.tiny import sample_batch
from spec_serve.worker import Worker, local_reply_endpoint


@pytest.fixture(scope="module")
def cluster(tiny_target_dir):
    with local_cluster(tiny_target_dir, workers=1) as c:
        yield c


@pytest.fixture(scope="module")
def reference(colocated_target):
    return colocated_target()


def _on_io_thread(client: RemoteTargetModel, fn) -> None:
    """Run ``fn`` on the client's I/O thread (it owns the sockets) and wait for it."""
    done = threading.Event()
    client._io.call(lambda: (fn(), done.set()))
    assert done.wait(10)


def _generate_both_kinds(client, tiny_target_dir, tiny_vocab_mapping, reference) -> None:
    client.set_vocab_mapping(*tiny_vocab_mapping)
    for seed, kind in enumerate(("eagle3", "dspark")):
        inputs = sample_batch(tiny_target_dir, batch=2, seq=16, seed=seed)
        assert_equal_batches(client.generate_batch(*inputs, kind=kind), reference.generate_batch(*inputs, kind=kind))


def test_same_host_replies_come_over_ipc(cluster, tiny_target_dir, tiny_vocab_mapping, reference):
    with RemoteTargetModel(cluster.frontend, timeout=60, max_retries=0, local_ipc=True) as client:
        local = client._io.reply_local
        assert local == {"endpoint": local["endpoint"], "host": local_host_key()}
        path = local["endpoint"].removeprefix("ipc://")
        assert os.path.exists(path)
        # Only the ipc endpoint is left: a reply sent to reply_to (tcp) would never arrive.
        _on_io_thread(client, lambda: client._io.data.unbind(client._io.data_endpoint))
        _generate_both_kinds(client, tiny_target_dir, tiny_vocab_mapping, reference)
        assert client.stats.local_replies == 2
        # A malformed reply_local is ignored by the worker: it replies to reply_to (tcp), and lives on.
        _on_io_thread(client, lambda: client._io.data.bind(client._io.data_endpoint))
        for bad in ([local["endpoint"]], 7, {"endpoint": 7, "host": local["host"]},
                    {"endpoint": local["endpoint"], "host": ["x"]}, {"endpoint": local["endpoint"], "host": "other"}):
            client._io.reply_local = bad  # what the next request header carries
            assert client.get_input_embeddings().weight.equal(reference.get_input_embeddings().weight)
        assert client.stats.local_replies == 2
    # The client removes its ipc socket file on close (libzmq leaves it).
    assert not os.path.exists(path)


def test_local_ipc_off_replies_over_tcp(cluster, tiny_target_dir, tiny_vocab_mapping, reference, monkeypatch):
    monkeypatch.delenv("SPEC_SERVE_LOCAL_IPC", raising=False)
    with RemoteTargetModel(cluster.frontend, timeout=60) as client:  # off by default
        assert client._io.reply_local is None
        _generate_both_kinds(client, tiny_target_dir, tiny_vocab_mapping, reference)
        assert client.stats.completed >= 2 and client.stats.local_replies == 0
    monkeypatch.setenv("SPEC_SERVE_LOCAL_IPC", "0")
    with RemoteTargetModel(cluster.frontend, timeout=60, local_ipc=None) as client:
        assert client._io.reply_local is None
        _generate_both_kinds(client, tiny_target_dir, tiny_vocab_mapping, reference)
        assert client.stats.local_replies == 0
    monkeypatch.setenv("SPEC_SERVE_LOCAL_IPC", "1")  # the environment turns it on
    with RemoteTargetModel(cluster.frontend, timeout=60) as client:
        assert client._io.reply_local is not None
        _generate_both_kinds(client, tiny_target_dir, tiny_vocab_mapping, reference)
        assert client.stats.local_replies == 2


def test_worker_endpoint_choice(tmp_path, colocated_target, monkeypatch):
    """ipc only for a well-formed reply_local with our host key and a live socket file; else reply_to."""
    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path}/c.sock"
    pull.bind(endpoint)
    (tmp_path / "plain").write_text("not a socket")
    key = local_host_key()
    try:
        assert local_reply_endpoint({"reply_local": {"endpoint": endpoint, "host": key}}, key) == endpoint
        refused = [
            {"endpoint": endpoint, "host": key + "x"},  # another host (or namespace)
            {"endpoint": f"ipc://{tmp_path}/gone.sock", "host": key},  # no socket file
            {"endpoint": f"ipc://{tmp_path}/plain", "host": key},  # a file, not a socket
            {"endpoint": "tcp://127.0.0.1:1", "host": key},
            {"endpoint": "ipc://c.sock", "host": key},  # relative: depends on the cwd
            {"endpoint": f"ipc://{tmp_path}/\x00c.sock", "host": key},
            {"endpoint": "ipc:///" + "a" * 600, "host": key},
            {"endpoint": endpoint}, {"host": key}, {"endpoint": 5, "host": key}, {"endpoint": endpoint, "host": 5},
            {"endpoint": [endpoint], "host": key}, {"endpoint": endpoint, "host": [key]},
            [endpoint, key], endpoint, 7, None, 1.5,
        ]
        for bad in refused:
            assert local_reply_endpoint({"reply_local": bad}, key) is None, bad
        assert local_reply_endpoint({}, key) is None
        # Local ipc turned off on the worker: host key None, never ipc.
        assert local_reply_endpoint({"reply_local": {"endpoint": endpoint, "host": key}}, None) is None
        monkeypatch.setenv("SPEC_SERVE_LOCAL_IPC", "0")
        assert Worker(colocated_target(vocab_mapping=None), "tcp://127.0.0.1:1").host_key is None
    finally:
        pull.close(0)


def test_ipc_endpoint_is_curve_protected_like_tcp(tmp_path):
    """The ipc endpoint is the same CURVE-server socket: a peer without CURVE cannot push to it."""
    broker_public, _ = keygen(tmp_path / "broker", "broker")
    _, client_secret = keygen(tmp_path / "client", "client")
    _, worker_secret = keygen(tmp_path / "worker", "worker")  # its directory admits worker.key (public keys only)
    security = Security(client_secret, server_key_file=broker_public, worker_keys_dir=tmp_path / "worker")
    ctx = zmq.Context.instance()
    # No broker behind this address: only the client's data socket is exercised.
    with RemoteTargetModel(f"tcp://127.0.0.1:{free_port()}", security=security, timeout=5,
                           local_ipc=True) as client:
        endpoint = client._io.reply_local["endpoint"]
        forged = data_message(Status.OK, os.urandom(16), {"via": "ipc"})
        plain = make_socket(ctx, zmq.PUSH, connect=endpoint)
        curve = make_socket(ctx, zmq.PUSH, connect=endpoint, security=Security(worker_secret),
                            curve_server_key=client._io.data_key.encode())
        try:
            plain.send_multipart(forged, flags=zmq.NOBLOCK)
            time.sleep(1.0)
            assert client.stats.local_replies == 0 and client.stats.duplicates == 0
            curve.send_multipart(forged, flags=zmq.NOBLOCK)
            deadline = time.monotonic() + 10
            while client.stats.local_replies == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert client.stats.local_replies == 1 and client.stats.unknown == 1  # no such request: dropped
        finally:
            plain.close(0)
            curve.close(0)
