"""Ordinary use that used to break a cluster (issue 14, items 1-7), each against real processes.

One cluster is shared in file order: a broker with ``--max-message-bytes 1 MiB`` and three test-only
hf workers that die, as a crashing engine would, on a batch whose ids are all ``POISON``. The poison
test runs last: it kills two of them. The STATUS test runs its own broker with a few hundred raw
protocol peers registered as workers (real HF workers by the hundred do not fit on a CI box).
Results are compared bit for bit with the colocated ``HFTarget`` (sharded: the contract, docs/equality.md).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
import zmq

from cluster_util import (
    CLIENT_KW,
    FAST_ENV,
    assert_contract,
    assert_equal_batches,
    start_crashing_worker,
    wait_until,
)
from spec_serve.client.api import RemoteError, RemoteTargetModel
from spec_serve.protocol import wire
from spec_serve.protocol.commands import (
    CLIENT_TAG,
    PART_BYTES,
    WORKER_TAG,
    ClientCommand,
    WorkerCommand,
    control,
    in_parts,
    new_request_id,
    parse_control,
)
from spec_serve.tools.launch import Cluster, free_port, local_cluster
from spec_serve.tools.tiny import sample_batch
from spec_serve.transport.sockets import Security

MAX_MESSAGE_BYTES = 1 << 20
POISON = 7


@pytest.fixture(scope="module")
def cluster(tiny_target_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("ordinary-logs")
    broker_args = ["--max-message-bytes", str(MAX_MESSAGE_BYTES)]  # --max-request-deaths: 2 by default
    with local_cluster(tiny_target_dir, workers=0, broker_args=broker_args, env=dict(FAST_ENV),
                       log_dir=log_dir) as c:
        for _ in range(3):
            start_crashing_worker(c, tiny_target_dir, POISON)
        c.wait_workers(3)
        yield c


@pytest.fixture(scope="module")
def engine(colocated_target):
    return colocated_target(vocab_mapping=None)


def _client(cluster, **kw) -> RemoteTargetModel:
    return RemoteTargetModel(cluster.frontend, **{"timeout": 30.0, **CLIENT_KW, **kw})


def _mapping(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft vocab of 256 of the tiny target's 512 ids, different for every seed."""
    ids = torch.randperm(512, generator=torch.Generator().manual_seed(seed))[:256].sort().values
    mask = torch.zeros(512, dtype=torch.bool)
    mask[ids] = True
    return ids, mask


class RawPeer:
    """A DEALER that speaks the protocol frame by frame: for inputs the client library never sends."""

    def __init__(self, endpoint: str, identity: bytes | None = None):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.connect(endpoint)

    def send(self, frames: list) -> None:
        self.sock.send_multipart(frames)

    def errors(self, count: int, timeout: float) -> dict[bytes, dict]:
        """The next ``count`` ERROR replies (by request id), fewer if time runs out; heartbeats meanwhile,
        as a live client does (the broker forgets a silent one, and what it sent)."""
        found: dict[bytes, dict] = {}
        deadline = time.monotonic() + timeout
        while len(found) < count and time.monotonic() < deadline:
            self.send(control(CLIENT_TAG, ClientCommand.HEARTBEAT.value))
            if not self.sock.poll(100):
                continue
            msg = parse_control(self.sock.recv_multipart(), CLIENT_TAG, ClientCommand)
            if msg.command == ClientCommand.ERROR.value:
                found[msg.request_id] = msg.header
        return found

    def close(self) -> None:
        self.sock.close(0)


# ------------------------------------------------------------ 1. vocab mappings


def test_any_number_of_vocab_mappings_over_time(cluster, tiny_target_dir, engine):
    """17 mappings in turn on one client, then back to the first (which every worker evicted): each
    batch is sent as three shards and meets the contract with the colocated one (each shard bit-equal to
    the forward of its row); the broker keeps only the live mapping. Then 17 clients at once, each with
    its own mapping."""
    inputs = sample_batch(tiny_target_dir, batch=3, seq=8, seed=21)
    with _client(cluster, num_shards=3) as client:
        for seed in [*range(17), 0]:
            client.set_vocab_mapping(*_mapping(seed))
            engine.set_vocab_mapping(*_mapping(seed))
            sent = client.stats.sent
            assert_contract(client.generate_batch(*inputs), engine, inputs, "eagle3", shards=3)
            assert client.stats.sent - sent == 3
        wait_until(lambda: client.status("default")["services"]["default"]["vocab_mappings"] == 1, 10,
                   what="only the live mapping kept")
    clients = [_client(cluster) for _ in range(17)]
    try:
        futures = []
        for seed, c in enumerate(clients, start=100):
            c.set_vocab_mapping(*_mapping(seed))
            futures.append(c.generate_batch_async(*inputs))
        for seed, future in enumerate(futures, start=100):
            engine.set_vocab_mapping(*_mapping(seed))
            assert_equal_batches(future.result(timeout=60), engine.generate_batch(*inputs, kind="eagle3"))
    finally:
        for c in clients:
            c.close()


# ------------------------------------------------------------ 2. STATUS at scale


def test_status_pages_hundreds_of_workers_and_forgets_idle_services(engine, tmp_path):
    """300 workers (raw peers sending READY) and 1,000 service names: target_info(), status() and
    ``spec-serve status`` all work; names no one uses any more are forgotten."""
    env = {"SPEC_SERVE_HEARTBEAT_LIVENESS": "100000", "SPEC_SERVE_UNKNOWN_SERVICE_GRACE": "600"}
    broker = Cluster.on_free_ports(env=env, log_dir=tmp_path)
    peers: list[RawPeer] = []
    junk: list[RawPeer] = []
    try:
        broker.start_broker()
        info = engine.target_info().to_dict()
        for _ in range(300):
            peers.append(RawPeer(broker.backend, identity=uuid.uuid4().bytes))
            peers[-1].send(control(WORKER_TAG, WorkerCommand.READY.value, "big", header={"target_info": info,
                                                                                        "capacity": 1}))
        wait_until(lambda: len(broker.get("/workers")[1]["workers"]) == 300, 60, what="300 workers registered")
        # Requests queued for 1,000 names no worker serves (4 peers: 256 requests at most per client).
        junk += [RawPeer(broker.frontend) for _ in range(4)]
        for i in range(1000):
            junk[i % 4].send(control(CLIENT_TAG, ClientCommand.REQUEST.value, f"junk-{i}", new_request_id(),
                                     {"reply_to": "tcp://127.0.0.1:9", "timeout": 600}))
        with RemoteTargetModel(broker.frontend, service="big", timeout=20, max_retries=0, **CLIENT_KW) as client:
            wait_until(lambda: client.status()["service_count"] == 1001, 30, what="1,000 junk services")
            assert client.target_info().to_dict() == info
            status = client.status()
            assert len(status["workers"]) == status["worker_count"] == 300
            assert len(status["services"]) == 1001 and status["services"]["big"]["workers"] == 300
            out = subprocess.run([sys.executable, "-m", "spec_serve.tools.cli", "status", "--broker", broker.frontend,
                                  "--json"], capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr
            assert len(json.loads(out.stdout)["workers"]) == 300
            for peer in junk:
                peer.send(control(CLIENT_TAG, ClientCommand.DISCONNECT.value))
            wait_until(lambda: set(client.status()["services"]) == {"big"}, 30, what="junk services forgotten")
            # A connected client keeps at most 16 registrations: the services of older ones go too.
            vocab = wire.encode({"selected_token_ids": torch.tensor([0, 1]),
                                 "selected_token_mask": torch.tensor([True, True, False])})
            for i in range(40):
                junk[0].send(control(CLIENT_TAG, ClientCommand.SET_VOCAB.value, f"vocab-{i}", new_request_id(), {},
                                     vocab))
            wait_until(lambda: client.status()["service_count"] == 17, 30, what="16 live registrations")
    finally:
        for peer in peers + junk:
            peer.close()
        broker.stop()


# ------------------------------------------------------------ 4. undeliverable replies


def test_an_undeliverable_reply_frees_the_worker_at_once(cluster, tiny_target_dir, engine):
    """16 requests whose reply endpoint refuses connections or never speaks ZeroMQ: each is answered
    'unavailable' (could not deliver) at once, and another client's small batch is served in seconds
    (it waited out the 60 s reply timeout before)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()  # accepts, never reads, never completes a ZeroMQ handshake
    endpoints = [f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{listener.getsockname()[1]}"]
    payload = wire.encode(dict(zip(("input_ids", "attention_mask", "loss_mask"),
                                   sample_batch(tiny_target_dir, batch=2, seq=16, seed=31))))
    bad = RawPeer(cluster.frontend)
    try:
        ids = []
        for i in range(16):
            ids.append(new_request_id())
            bad.send(control(CLIENT_TAG, ClientCommand.REQUEST.value, "default", ids[-1],
                             {"op": "generate", "kind": "dspark", "timeout": 120, "reply_to": endpoints[i % 2]},
                             payload))
        inputs = sample_batch(tiny_target_dir, batch=1, seq=8, seed=32)
        with _client(cluster, max_retries=0) as good:
            start, done = time.monotonic(), []
            future = good.generate_batch_async(*inputs, kind="dspark")
            future.add_done_callback(lambda _: done.append(time.monotonic() - start))
            errors = bad.errors(16, timeout=30)
            got = future.result(timeout=60)
        assert_equal_batches(got, engine.generate_batch(*inputs, kind="dspark"))
        assert done[0] < 15, f"a small batch took {done[0]:.1f}s beside undeliverable replies"
        assert set(errors) == set(ids)
        assert all(e["code"] == "unavailable" and "could not deliver" in e["error"] for e in errors.values()), errors
    finally:
        bad.close()
        listener.close()


# ------------------------------------------------------------ 5. size limits


def test_oversize_request_fails_at_once_naming_the_limit(cluster, tiny_target_dir, engine):
    """A request over the broker's 1 MiB, with one tensor (one frame) over it, which makes libzmq drop
    the connection unanswered: ValueError before sending; the same client then works."""
    ids = torch.randint(0, 512, (160, 1024))
    with _client(cluster, max_retries=0, timeout=10) as client:
        start = time.monotonic()
        with pytest.raises(ValueError, match=str(MAX_MESSAGE_BYTES)):
            client.generate_batch(ids, torch.ones_like(ids), torch.ones_like(ids), kind="dspark")
        assert time.monotonic() - start < 5
        inputs = sample_batch(tiny_target_dir, batch=2, seq=16, seed=41)
        assert_equal_batches(client.generate_batch(*inputs, kind="dspark"),
                             engine.generate_batch(*inputs, kind="dspark"))


def test_a_request_over_a_part_travels_in_parts_and_is_served_bit_equal(cluster, tiny_target_dir, engine):
    """A shard whose payload passes PART_BYTES goes to the broker in parts (no message to the broker is
    large, docs/protocol.md), is joined there, reaches the worker whole, and comes back bit-equal."""
    inputs = sample_batch(tiny_target_dir, batch=4, seq=3000, seed=43)
    parts = in_parts(control(CLIENT_TAG, ClientCommand.REQUEST.value, "default", b"", {}, wire.encode(
        {"input_ids": inputs[0], "attention_mask": inputs[1], "loss_mask": inputs[2]})))
    with _client(cluster) as client:
        got = client.generate_batch(*inputs, kind="dspark")
    print(f"\n4 x 3000 tokens: one request in {len(parts)} parts of at most {PART_BYTES >> 10} KiB, served bit-equal")
    assert len(parts) >= 2
    assert_equal_batches(got, engine.generate_batch(*inputs, kind="dspark"))


def test_reply_over_the_client_limit_fails_once_naming_both_sizes(cluster, tiny_target_dir):
    """A reply larger than the client's max_message_bytes is refused by the worker, computed once:
    ValueError naming the reply's size and the limit, no retries, no timeout."""
    limit = 32 << 10
    inputs = sample_batch(tiny_target_dir, batch=2, seq=64, seed=42)
    with _client(cluster, max_retries=3, timeout=10, max_message_bytes=limit) as client:
        start = time.monotonic()
        with pytest.raises(ValueError, match=rf"reply of \d+ bytes exceeds the client's max_message_bytes of {limit}"):
            client.generate_batch(*inputs, kind="dspark")
        assert time.monotonic() - start < 8
        assert client.stats.retried == 0


# ------------------------------------------------------------ 6. deep JSON headers


@pytest.mark.parametrize("field", [
    pytest.param("[" * 977 + "]" * 977, id="977-deep"),
    pytest.param("[" * 5000 + "]" * 5000, id="5000-deep"),
    pytest.param("1" * 5000, id="5000-digit-int"),
])
def test_header_too_deep_is_refused_with_its_request_id(cluster, tiny_target_dir, engine, field):
    """The error names the request (its sender fails it at once), and a retry is refused the same way
    instead of being swallowed as the duplicate of a request stuck in the broker."""
    peer = RawPeer(cluster.frontend)
    try:
        request_id = new_request_id()
        header = ('{"op":"generate","kind":"dspark","timeout":30,"reply_to":"tcp://127.0.0.1:9","x":'
                  + field + "}").encode()
        frames = [CLIENT_TAG, ClientCommand.REQUEST.value, b"default", request_id, header]
        for attempt in range(2):
            peer.send(frames)
            errors = peer.errors(1, timeout=10)
            assert request_id in errors, f"attempt {attempt}: no error for the request"
            assert errors[request_id]["code"] == "bad_request"
    finally:
        peer.close()
    with _client(cluster) as client:
        inputs = sample_batch(tiny_target_dir, batch=2, seq=16, seed=61)
        assert_equal_batches(client.generate_batch(*inputs, kind="dspark"),
                             engine.generate_batch(*inputs, kind="dspark"))


# ------------------------------------------------------------ 7. failed constructors


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _settled_fds() -> int:
    """Open descriptors once ZeroMQ's I/O thread has closed what closed sockets held (it does so
    asynchronously): the count after it stopped changing for half a second."""
    last, since = _open_fds(), time.monotonic()
    while time.monotonic() - since < 0.5:
        time.sleep(0.05)
        now = _open_fds()
        if now != last:
            last, since = now, time.monotonic()
    return last


@pytest.mark.parametrize("kwargs", [
    pytest.param({"broker_url": "tcp://127.0.0.1"}, id="broker-url-without-port"),
    pytest.param({"broker_url": "tcp://127.0.0.1:5555", "advertise_host": "256.0.0.1"}, id="bad-advertise-host"),
    pytest.param({"broker_url": "tcp://127.0.0.1:5555", "security": Security(Path("/nonexistent.key_secret"))},
                 id="missing-key-file"),
])
def test_a_failed_constructor_leaks_no_descriptor(kwargs):
    kwargs = dict(kwargs)
    url = kwargs.pop("broker_url")
    # Each case fails its own way (bad URL, bad address, missing key): any error will do, the test counts
    # descriptors. The first failure may open the process-wide ZeroMQ context.
    with pytest.raises(Exception):  # noqa: B017
        RemoteTargetModel(url, **kwargs)
    before = _settled_fds()
    for _ in range(20):
        with pytest.raises(Exception):  # noqa: B017
            RemoteTargetModel(url, **kwargs)
    # ZeroMQ's I/O thread closes them when it gets to it (a loaded box may pause it longer than any quiet
    # spell): wait for the count to come back; a leaked descriptor never does.
    wait_until(lambda: _open_fds() <= before, 60, interval=0.05, what=f"descriptors back to {before}")


# ------------------------------------------------------------ 3. a request that kills workers (last)


# The error names the request's input and the workers lost, so the user can find the input.
KILLED = (r"request [0-9a-f]{32} \(generate dspark 8 tokens, input_ids \[1, 8\] I64, attention_mask \[1, 8\] I64, "
          r"loss_mask \[1, 8\] I64\) was on 2 workers of 'default' as they died "
          r"\([0-9a-f]{12} \(host .+, pid \d+\); [0-9a-f]{12} \(host .+, pid \d+\)\)")


def test_a_request_that_kills_workers_fails_alone(cluster, tiny_target_dir, engine):
    """A batch that kills every worker it reaches fails after two deaths (--max-request-deaths 2) with a
    RemoteError naming its input (op, kind, tokens, each tensor's shape) and the workers lost (host, pid),
    and spec_serve_killer_requests counts it; a batch sent beside it and the next one are served by the
    surviving worker, bit-equal."""
    poison = torch.full((1, 8), POISON)
    good = sample_batch(tiny_target_dir, batch=2, seq=16, seed=71)
    with _client(cluster, timeout=45, max_retries=0, prefetch_depth=2) as client:
        beside = client.generate_batch_async(*good, kind="dspark")
        start = time.monotonic()
        with pytest.raises(RemoteError, match=KILLED) as failed:
            client.generate_batch(poison, torch.ones_like(poison), torch.ones_like(poison), kind="dspark")
        assert time.monotonic() - start < 45
        assert_equal_batches(beside.result(timeout=60), engine.generate_batch(*good, kind="dspark"))
        assert_equal_batches(client.generate_batch(*good, kind="dspark"), engine.generate_batch(*good, kind="dspark"))
    dead = [p.pid for p in cluster.workers if p.poll() is not None]
    assert len(dead) == 2, "exactly two workers died"
    assert all(f"pid {pid})" in str(failed.value) for pid in dead), failed.value
    _, metrics = cluster.get("/metrics")
    assert "spec_serve_killer_requests_total 1.0" in metrics.splitlines()
    print(f"\npoison request: {failed.value}")
