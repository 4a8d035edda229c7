"""Bad input on every socket and route: clear error replies, or dropped and logged; nothing stops serving.

Raw DEALER sockets against the broker frontend and backend, a raw PUSH against a
client's data socket and raw TCP against the HTTP shim; afterwards a normal
client still gets results torch.equal to the colocated forward.
"""

from __future__ import annotations

import json
import random
import socket
import struct
import time
import uuid

import pytest
import torch
import zmq

from cluster_util import CLIENT_KW, FAST_ENV, Reference, same, wait_until, workers
from spec_serve.client.api import RemoteTargetModel
from spec_serve.protocol import wire
from spec_serve.protocol.commands import (
    CLIENT_TAG,
    DATA_TAG,
    WORKER_TAG,
    ClientCommand,
    Status,
    WorkerCommand,
    control,
    in_parts,
    parse_control,
    parse_data,
)
from spec_serve.tools.launch import local_cluster

MAX_MESSAGE = 4 << 20  # the configured maximum: SPEC_SERVE_MAX_MESSAGE_BYTES / --max-message-bytes
REPLY_WAIT_MS = 15000


@pytest.fixture(scope="module")
def cluster(tiny_target_dir, tmp_path_factory):
    env = {**FAST_ENV, "SPEC_SERVE_MAX_MESSAGE_BYTES": str(MAX_MESSAGE)}
    with local_cluster(tiny_target_dir, workers=1, env=env, log_dir=tmp_path_factory.mktemp("fuzz-logs")) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_target_dir, tiny_vocab_mapping):
    return Reference(tiny_target_dir, tiny_vocab_mapping)


@pytest.fixture()
def ctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def _dealer(ctx, endpoint):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
    sock.connect(endpoint)
    return sock


def _recv(sock, timeout_ms=REPLY_WAIT_MS):
    """The next reply that is not a broker heartbeat (raw peers get those too)."""
    deadline = time.monotonic() + timeout_ms / 1000
    while sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
        frames = sock.recv_multipart()
        if len(frames) >= 2 and frames[1] in (ClientCommand.HEARTBEAT.value, WorkerCommand.HEARTBEAT.value) \
                and frames[0] in (CLIENT_TAG, WORKER_TAG):
            continue
        return frames
    return None


def _request_payload(ids=None, attn=None, loss=None):
    ids = torch.randint(4, 500, (2, 16)) if ids is None else ids
    attn = torch.ones_like(ids) if attn is None else attn
    loss = torch.ones_like(ids) if loss is None else loss
    return [bytes(memoryview(f)) for f in wire.encode({"input_ids": ids, "attention_mask": attn, "loss_mask": loss})]


def _lying_payload():
    header = json.dumps({"input_ids": {"dtype": "I64", "shape": [2, 16], "data_offsets": [0, 1 << 40]}}).encode()
    header += b" " * (-len(header) % 8)
    return [struct.pack("<Q", len(header)) + header, b"\0" * 256]


def _metric(cluster, name: str) -> float:
    _, text = cluster.get("/metrics")
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name) and "_created" not in line)


def test_bad_client_messages_get_error_replies(cluster, ctx):
    """Each malformed frontend message gets a BAD_REQUEST error naming what is wrong."""
    rid = lambda: uuid.uuid4().bytes  # noqa: E731
    hdr = {"op": "generate", "kind": "dspark", "timeout": 30, "reply_to": "tcp://127.0.0.1:9"}
    req = ClientCommand.REQUEST.value
    cases = {
        "random bytes": [b"\x93\x17garbage"],
        "truncated": [CLIENT_TAG, req, b"default"],
        "reordered frames": [req, CLIENT_TAG, b"default", rid(), json.dumps(hdr).encode()],
        "wrong protocol tag": [b"HTTP/1", req, b"default", rid(), b"{}"],
        "wrong version": [b"SPSC99", req, b"default", rid(), b"{}"],
        # (A current worker's tag is answered as a worker on the wrong port: test_operability.py.)
        "other worker version on frontend": [b"SPSW99", req, b"default", rid(), b"{}"],
        "unknown command": [CLIENT_TAG, b"\x7f", b"default", rid(), b"{}"],
        "command clients may not send": [CLIENT_TAG, ClientCommand.VOCAB_OK.value, b"default", rid(), b"{}"],
        "short request id": [CLIENT_TAG, req, b"default", b"12345", json.dumps(hdr).encode()],
        "header not JSON": [CLIENT_TAG, req, b"default", rid(), b"{not json"],
        "header not an object": [CLIENT_TAG, req, b"default", rid(), b"[1,2]"],
        "service not UTF-8": [CLIENT_TAG, req, b"\xff\xfe", rid(), json.dumps(hdr).encode()],
        "no reply_to": [*control(CLIENT_TAG, req, "default", rid(), {"timeout": 5})],
        "reply_to not an endpoint": [*control(CLIENT_TAG, req, "default", rid(), {**hdr, "reply_to": "garbage"})],
        "timeout not a number": [*control(CLIENT_TAG, req, "default", rid(), {**hdr, "timeout": "soon"})],
        "vocab not a digest": [*control(CLIENT_TAG, req, "default", rid(), {**hdr, "vocab": [1]})],
        "unknown vocab digest": [*control(CLIENT_TAG, req, "default", rid(), {**hdr, "vocab": "ab" * 16})],
        # Sent in parts, as a client does: refused at its first part, from the size its header declares.
        "oversized request": [*control(CLIENT_TAG, req, "default", rid(), hdr), *([b"\0" * (2 << 20)] * 3)],
        "parts that lie": ([*control(CLIENT_TAG, req, "default", lying := rid(), {**hdr, "parts": 2, "bytes": 8}),
                            b"\0" * 4], [*control(CLIENT_TAG, ClientCommand.PART.value, "default", lying), b"\0" * 9]),
        "set_vocab garbage": [*control(CLIENT_TAG, ClientCommand.SET_VOCAB.value, "default", rid()), b"junk"],
        "set_vocab lying header": [*control(CLIENT_TAG, ClientCommand.SET_VOCAB.value, "default", rid()),
                                   *_lying_payload()],
        "set_vocab wrong dtype": [*control(CLIENT_TAG, ClientCommand.SET_VOCAB.value, "default", rid()),
                                  *[bytes(memoryview(f)) for f in wire.encode({
                                      "selected_token_ids": torch.arange(4, dtype=torch.float32),
                                      "selected_token_mask": torch.zeros(512, dtype=torch.bool)})]],
    }
    sock = _dealer(ctx, cluster.frontend)
    bad_before = _metric(cluster, "spec_serve_bad_messages")
    for name, frames in cases.items():
        for message in frames if isinstance(frames, tuple) else in_parts(frames):
            sock.send_multipart(message)
        reply = _recv(sock)
        assert reply is not None, f"{name}: no reply"
        msg = parse_control(reply, CLIENT_TAG, ClientCommand)
        assert msg.command == ClientCommand.ERROR.value, f"{name}: {msg}"
        assert msg.header["code"] == "bad_request", f"{name}: {msg.header}"
        print(f"  {name:32s} -> {msg.header['code']}: {msg.header['error'][:90]}")
    # Frame over MAXMSGSIZE: libzmq drops the peer before allocating; nobody to answer.
    big = _dealer(ctx, cluster.frontend)
    big.send_multipart([CLIENT_TAG, req, b"default", rid(), b"{}", b"\0" * (MAX_MESSAGE + (1 << 20))])
    assert _recv(big, 2000) is None
    sock.send_multipart(control(CLIENT_TAG, ClientCommand.STATUS.value, "default", rid()))
    reply = _recv(sock)
    assert reply is not None and parse_control(reply, CLIENT_TAG, ClientCommand).command == ClientCommand.STATUS.value
    assert cluster.broker.poll() is None
    print(f"bad client messages: {len(cases)} cases answered; bad_messages metric "
          f"{bad_before:g} -> {_metric(cluster, 'spec_serve_bad_messages'):g}")


def test_bad_requests_reach_worker_and_get_error_data_replies(cluster, ctx):
    """Requests the broker forwards but the worker must refuse: an error data message on reply_to."""
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    reply_to = f"tcp://127.0.0.1:{port}"
    sock = _dealer(ctx, cluster.frontend)
    base = {"op": "generate", "kind": "dspark", "timeout": 30, "reply_to": reply_to}
    ids = torch.randint(4, 500, (2, 16))
    cases = {
        "payload random bytes": (base, [b"\x01\x02\x03 not safetensors"]),
        "header lies about sizes": (base, _lying_payload()),
        "token id out of range": (base, _request_payload(ids=torch.full((2, 16), 10 ** 6))),
        "negative token id": (base, _request_payload(ids=torch.full((2, 16), -1))),
        "float input_ids": (base, _request_payload(ids=ids.float())),
        "mismatched shapes": (base, _request_payload(attn=torch.ones(2, 15, dtype=torch.long))),
        "3-D input": (base, _request_payload(ids=ids[None], attn=torch.ones(1, 2, 16, dtype=torch.long),
                                             loss=torch.ones(1, 2, 16, dtype=torch.long))),
        "missing tensor": (base, [bytes(memoryview(f)) for f in wire.encode({"input_ids": ids})]),
        "unknown op": ({**base, "op": "frobnicate"}, _request_payload()),
        "unknown kind": ({**base, "kind": "medusa"}, _request_payload()),
        "eagle3 without mapping": ({**base, "kind": "eagle3"}, _request_payload()),
        "embeddings which": ({**base, "op": "embeddings", "which": "sideways"}, []),
    }
    for name, (header, payload) in cases.items():
        request_id = uuid.uuid4().bytes
        sock.send_multipart(control(CLIENT_TAG, ClientCommand.REQUEST.value, "default", request_id, header, payload))
        assert pull.poll(REPLY_WAIT_MS), f"{name}: no data reply"
        status, got_id, reply_header, _ = parse_data(pull.recv_multipart())
        assert got_id == request_id and status is Status.ERROR, f"{name}: {status} {reply_header}"
        assert reply_header["code"] == "bad_request", f"{name}: {reply_header}"
        print(f"  {name:28s} -> {reply_header['code']}: {reply_header['error'][:90]}")
    assert [p.poll() for p in [cluster.broker, *cluster.workers]] == [None, None]
    print(f"bad worker-side requests: {len(cases)} cases answered with error data replies")


def test_bad_worker_messages_are_dropped(cluster, ctx):
    """The backend has no one to answer garbage: it is dropped and logged; junk never registers."""
    sock = _dealer(ctx, cluster.backend)
    before = _metric(cluster, "spec_serve_bad_messages")
    junk_info = {"target_info": {"vocab_size": "lots"}, "capacity": 2}
    messages = [
        [b"garbage"],
        [WORKER_TAG, b"\x66", b"default", b"", b"{}"],
        [b"SPSC99", WorkerCommand.READY.value, b"default", b"", b"{}"],  # the current client tag is told the port
        control(WORKER_TAG, WorkerCommand.READY.value, "default", header=junk_info),
        control(WORKER_TAG, WorkerCommand.READY.value, "default", header={"target_info": {}, "capacity": -1}),
        control(WORKER_TAG, WorkerCommand.REQUEST.value, "default", uuid.uuid4().bytes, {}),
        [WORKER_TAG, WorkerCommand.DONE.value, b"default", b"xx", b"{}"],
    ]
    for frames in messages:
        sock.send_multipart(frames)
    # An unregistered peer's DONE is answered with DISCONNECT (register again), not served. The broker reads a
    # peer's messages in order, so this answer also says the junk before it was handled, none registering us.
    sock.send_multipart(control(WORKER_TAG, WorkerCommand.DONE.value, "default", uuid.uuid4().bytes, {}))
    reply = _recv(sock, 5000)
    assert reply is not None and parse_control(reply, WORKER_TAG, WorkerCommand).command == \
        WorkerCommand.DISCONNECT.value
    after = wait_until(lambda: (m := _metric(cluster, "spec_serve_bad_messages")) - before >= len(messages) - 1 and m,
                       timeout=10, what="every junk message counted")
    print(f"bad worker messages: {len(messages)} sent, bad_messages metric {before:g} -> {after:g}, "
          f"workers registered {len(workers(cluster))}")
    assert len(workers(cluster)) == 1


def _mutate(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    frames = list(frames)
    op = rng.randrange(7)
    if op == 0 and len(frames) > 1:
        frames = frames[:rng.randrange(1, len(frames))]  # truncate
    elif op == 1 and len(frames) > 1:
        i, j = rng.sample(range(len(frames)), 2)
        frames[i], frames[j] = frames[j], frames[i]  # reorder
    elif op == 2:
        i = rng.randrange(len(frames))
        f = bytearray(frames[i] or b"\0")
        for _ in range(rng.randint(1, 4)):
            f[rng.randrange(len(f))] = rng.randrange(256)  # flip bytes
        frames[i] = bytes(f)
    elif op == 3:
        i = rng.randrange(len(frames))
        frames[i] = frames[i][:rng.randrange(len(frames[i]) + 1)]  # cut a frame
    elif op == 4:
        frames.insert(rng.randrange(len(frames) + 1), rng.randbytes(rng.randrange(64)))  # extra frame
    elif op == 5:
        frames = [rng.randbytes(rng.randrange(48)) for _ in range(rng.randint(1, 8))]  # pure noise
    else:
        i = rng.randrange(len(frames))
        frames[i] = json.dumps({"timeout": rng.choice([-1, 0, 1e309, "x", None, [], {}]),
                                "reply_to": rng.choice(["", "tcp://", "tcp://*:1", "ipc://", 5, None]),
                                "capacity": rng.choice([0, -5, 2 ** 70, "2"]),
                                "target_info": rng.choice([None, [], {"x": 1}])}).encode()
    return frames


def test_random_fuzz_then_normal_client_is_correct(cluster, reference, tiny_vocab_mapping, ctx):
    """Seeded random mutations on all four surfaces, then a normal client's results are torch.equal."""
    rng = random.Random(4)
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    reply_to = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
    valid_client = [
        control(CLIENT_TAG, ClientCommand.REQUEST.value, "default", uuid.uuid4().bytes,
                {"op": "generate", "kind": "dspark", "timeout": 5, "reply_to": reply_to}, _request_payload()),
        control(CLIENT_TAG, ClientCommand.SET_VOCAB.value, "default", uuid.uuid4().bytes, {}, _lying_payload()),
        control(CLIENT_TAG, ClientCommand.STATUS.value, "default", uuid.uuid4().bytes),
        control(CLIENT_TAG, ClientCommand.HEARTBEAT.value),
    ]
    valid_worker = [
        control(WORKER_TAG, WorkerCommand.HEARTBEAT.value),
        control(WORKER_TAG, WorkerCommand.DONE.value, "default", uuid.uuid4().bytes, {"status": "ok"}),
        control(WORKER_TAG, WorkerCommand.READY.value, "default", header={"target_info": {"x": 1}, "capacity": 1}),
    ]
    counts = {"frontend": 0, "backend": 0, "data": 0, "http": 0, "http_4xx": 0}
    front, back = _dealer(ctx, cluster.frontend), _dealer(ctx, cluster.backend)
    for _ in range(300):
        front.send_multipart([bytes(f) for f in _mutate(rng, [bytes(f) for f in rng.choice(valid_client)])])
        back.send_multipart([bytes(f) for f in _mutate(rng, [bytes(f) for f in rng.choice(valid_worker)])])
        counts["frontend"] += 1
        counts["backend"] += 1
        for s in (front, back, pull):
            while s.poll(0):
                s.recv_multipart()
    with RemoteTargetModel(cluster.frontend, timeout=30, **CLIENT_KW) as client:
        client.set_vocab_mapping(*tiny_vocab_mapping)
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(client._io.data_endpoint)
        data_valid = [DATA_TAG, Status.OK.value, uuid.uuid4().bytes, b"{}", *_lying_payload()]
        for _ in range(200):
            push.send_multipart(_mutate(rng, data_valid))
            counts["data"] += 1
        counts.update(_http_garbage(cluster.http_port, rng))
        time.sleep(0.5)
        # Normal service afterwards: correct, bit-equal results.
        results = [client.generate_batch(*reference.batch(seed)) for seed in range(3)]
        verified = sum(same(r, reference.expected(seed)) for seed, r in enumerate(results))
        dspark = client.generate_batch(*reference.batch(9), kind="dspark")
        verified += same(dspark, reference.expected(9, kind="dspark"))
    code, health = cluster.get("/health")
    alive = [p.poll() is None for p in [cluster.broker, *cluster.workers]]
    print(f"\nfuzz: {counts}; afterwards verified {verified}/4, health {code}, processes alive {alive}")
    assert verified == 4 and code == 200 and all(alive)


def _http_garbage(port: int, rng: random.Random) -> dict:
    payloads = [
        rng.randbytes(200),
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + rng.randbytes(64),  # a TLS hello
        b"GET\r\n\r\n",
        b"GET / HTTP/9.9\r\n\r\n",
        b"GET /workers HTTP/1.1\r\n" + b"X: " + b"a" * 70000 + b"\r\n\r\n",
        b"GET /" + b"a" * 10000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        b"POST /health HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\nxx",
        b"GET /model_info?service=%ff%fe HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n",
        b"".join(b"H%d: v\r\n" % i for i in range(200)),
        b"GET /health HTTP/1.1\r\nHost: x\r\n",  # never finished: the server times out, not us
    ]
    n = bad = 0
    for data in payloads:
        with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
            s.sendall(data)
            try:
                s.shutdown(socket.SHUT_WR)
                reply = s.recv(200)
            except OSError:
                reply = b""
        n += 1
        if reply[:12] in (b"HTTP/1.0 400", b"HTTP/1.1 400", b"HTTP/1.0 404", b"HTTP/1.1 404", b"HTTP/1.0 405",
                          b"HTTP/1.1 405", b"HTTP/1.0 414", b"HTTP/1.1 414", b"HTTP/1.0 431", b"HTTP/1.1 431",
                          b"HTTP/1.0 505", b"HTTP/1.1 505") or not reply:
            bad += 1
    return {"http": n, "http_4xx": bad}
