"""Hostile or broken peers: memory stays bounded, replies are checked, the HTTP shim cannot be starved.

Real broker, worker and client processes on loopback. Floods come from a hand-rolled ZMTP peer
(cluster_util.RawZmtpPeer) that sends a message whose frames never end, which libzmq holds whole
before the application sees any of it; memory is the peak RSS (VmHWM) of the process under attack.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch
import zmq

import zygote
from cluster_util import (
    CLIENT_KW,
    FAST_ENV,
    HEARTBEAT_INTERVAL,
    HERE,
    RawZmtpPeer,
    Reference,
    peak_rss_kib,
    reset_peak_rss,
    same,
    wait_until,
    workers,
)
from spec_serve.client.api import RemoteTargetModel
from spec_serve.protocol import wire
from spec_serve.protocol.commands import (
    CLIENT_TAG,
    CONTROL_FRAMES,
    DATA_TAG,
    PART_FRAMES,
    WORKER_TAG,
    ClientCommand,
    Status,
    WorkerCommand,
    control,
    data_message,
    frame_limit,
    in_parts,
    parse_control,
)
from spec_serve.tools.launch import local_cluster
from spec_serve.tools.tiny import sample_batch

MAX_MESSAGE = 4 << 20  # the cluster's --max-message-bytes
FLOOD = 384 << 20  # what an attacker tries to make a process hold
# Peak growth allowed under a flood: the per-connection limit (at most 2 x MAX_MESSAGE + 1 MiB on the
# frontend) plus what arrives within one check of the ingress watcher on a loaded box.
PEAK_BOUND = 96 << 20


@pytest.fixture(scope="module")
def reference(tiny_target_dir, tiny_vocab_mapping):
    return Reference(tiny_target_dir, tiny_vocab_mapping)


@pytest.fixture(scope="module")
def cluster(tiny_target_dir, tmp_path_factory):
    env = {**FAST_ENV, "SPEC_SERVE_MAX_MESSAGE_BYTES": str(MAX_MESSAGE)}
    with local_cluster(tiny_target_dir, workers=1, env=env, log_dir=tmp_path_factory.mktemp("hostile-logs")) as c:
        yield c


def _flood(pid: int, endpoint: str, first_frames: list[bytes], socket_type: bytes = b"DEALER",
           chunk: int = 1 << 20) -> tuple[int, int]:
    """(bytes sent before the connection was cut, peak RSS growth of ``pid``) for one never-ending message of
    ``chunk``-byte frames; fails unless the receiver cut the connection (a send that times out, or a receiver
    that took it all, is not a cut)."""
    reset_peak_rss(pid)
    before = peak_rss_kib(pid) << 10
    peer = RawZmtpPeer(endpoint, socket_type)
    try:
        sent, cut = peer.flood(first_frames, FLOOD, chunk=chunk)
    finally:
        peer.close()
    assert cut, f"the flooding peer was not cut off: {sent >> 20} of {FLOOD >> 20} MiB sent, connection still open"
    return sent, (peak_rss_kib(pid) << 10) - before


@pytest.mark.parametrize("chunk", [1 << 20, 32 << 10], ids=["frames-over-the-frame-bound", "frames-under-it"])
@pytest.mark.parametrize("side", ["frontend", "backend"])
def test_never_ending_message_to_the_broker_is_cut_off(cluster, side, chunk):
    """A peer that sends frame after frame of one message (no credentials, never registered) is
    disconnected near the limit; the broker's memory does not follow the flood, and it keeps serving.
    Frames over the side's frame bound are refused by libzmq itself; smaller ones only the ingress watcher
    stops, and its cut is logged."""
    if side == "frontend":
        endpoint, first = cluster.frontend, [CLIENT_TAG, ClientCommand.REQUEST.value, b"default", uuid.uuid4().bytes,
                                             b'{"reply_to":"tcp://127.0.0.1:9"}']
    else:
        endpoint, first = cluster.backend, [WORKER_TAG, WorkerCommand.READY.value, b"default", b"", b"{}"]
    log = cluster.log_path("broker")
    cuts = log.read_text().count("ingress.dropped")
    sent, grew = _flood(cluster.broker.pid, endpoint, first, chunk=chunk)
    if chunk < 64 << 10:  # under both sides' frame bounds: only the watcher can stop it, and it logs its cut
        wait_until(lambda: sent == FLOOD or log.read_text().count("ingress.dropped") > cuts, 10, interval=0.05,
                   what="the ingress watcher's cut logged")
    cut = log.read_text().count("ingress.dropped") - cuts
    print(f"\n{side}, frames of {chunk >> 10} KiB: cut off after {sent >> 20} of {FLOOD >> 20} MiB ({cut} cut by "
          f"the ingress watcher); broker peak RSS +{grew >> 20} MiB")
    assert sent < FLOOD, "the broker never cut the flooding peer off"
    assert grew < PEAK_BOUND
    assert cut == (1 if chunk < 64 << 10 else 0)
    with RemoteTargetModel(cluster.frontend, timeout=30, **CLIENT_KW) as client:
        assert client.status()["workers"], "the broker lost its worker"


def _metric(cluster, name: str) -> float:
    """The sum of a broker metric's samples whose line starts with ``name`` (labels included)."""
    _, text = cluster.get("/metrics")
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


# Empty frames in one whole message: a count the receiver refuses unread (its bytes, 2 a frame, are under the
# broker's per-connection bounds, so it arrives whole), and one the ingress watcher cuts off before it is whole.
FRAMES_WHOLE = 60_000
FRAMES_CUT = 4_000_000


def _flood_while_asking(client, endpoint: str, first: list[bytes], count: int, done) -> tuple[int, float]:
    """Send one message of ``count`` empty frames from a raw peer while ``client`` asks STATUS again and again,
    until the flood is sent, ``done()``, and 2 s more (the broker may still be reading it); (bytes sent before
    a cut, the slowest STATUS answer)."""
    peer, sent = RawZmtpPeer(endpoint), []
    flood = threading.Thread(target=lambda: sent.append(peer.many_frames(first, count)), daemon=True)
    slowest, deadline, settled = 0.0, time.monotonic() + 60, float("inf")
    flood.start()
    try:
        while time.monotonic() < min(deadline, settled):
            if settled == float("inf") and not flood.is_alive() and done():
                settled = time.monotonic() + 2.0
            start = time.monotonic()
            client.status()
            slowest = max(slowest, time.monotonic() - start)
            time.sleep(0.02)
    finally:
        flood.join(60)
        peer.close()
    return sent[0], slowest


@pytest.mark.parametrize("side", ["frontend", "backend"])
def test_message_of_many_frames_holds_up_nothing(cluster, side):
    """One message of very many empty frames (no credentials, never registered): the broker refuses it by
    its frame count without building the frames (or cuts it off before it is whole), every STATUS asked
    meanwhile is answered promptly, no worker misses a heartbeat, and broker memory stays flat."""
    endpoint, first = (cluster.frontend, [CLIENT_TAG, ClientCommand.REQUEST.value, b"default", uuid.uuid4().bytes,
                                          b'{"reply_to":"tcp://127.0.0.1:9"}']) if side == "frontend" else \
        (cluster.backend, [WORKER_TAG, WorkerCommand.HEARTBEAT.value, b"", b"", b"{}"])
    pid, served_by = cluster.broker.pid, sorted(w["id"] for w in workers(cluster, "default"))
    refused_metric = f'spec_serve_refused_messages_total{{socket="{side}"}}'
    deaths, refused = _metric(cluster, "spec_serve_worker_deaths_total"), _metric(cluster, refused_metric)
    reset_peak_rss(pid)
    before = peak_rss_kib(pid) << 10
    with RemoteTargetModel(cluster.frontend, timeout=30, **CLIENT_KW) as client:
        client.status()
        whole = _flood_while_asking(client, endpoint, first, FRAMES_WHOLE,
                                    lambda: _metric(cluster, refused_metric) > refused)
        cut = _flood_while_asking(client, endpoint, first, FRAMES_CUT, lambda: True)
    grew = (peak_rss_kib(pid) << 10) - before
    refused = _metric(cluster, refused_metric) - refused
    print(f"\n{side}: {FRAMES_WHOLE} frames refused unread ({refused:g}), slowest STATUS meanwhile {whole[1]:.2f}s; "
          f"{FRAMES_CUT} frames cut after {cut[0] >> 10} KiB, slowest STATUS {cut[1]:.2f}s; broker peak RSS "
          f"+{grew >> 20} MiB")
    assert refused >= 1 and cut[0] < 2 * FRAMES_CUT
    assert max(whole[1], cut[1]) < 5.0  # before: minutes (the whole message built frame object by frame object)
    assert _metric(cluster, "spec_serve_worker_deaths_total") == deaths
    assert sorted(w["id"] for w in workers(cluster, "default")) == served_by
    assert grew < 64 << 20


# Every command a client may send, with a header the broker would read.
CLIENT_KINDS = [ClientCommand.REQUEST, ClientCommand.SET_VOCAB, ClientCommand.PART, ClientCommand.STATUS,
                ClientCommand.DISCONNECT, ClientCommand.BIND, ClientCommand.RELEASE, ClientCommand.HEARTBEAT]


def _error_for(sock: zmq.Socket, request_id: bytes, timeout: float = 20.0):
    """The broker's ERROR answering ``request_id`` (heartbeats and other answers skipped), or None."""
    deadline = time.monotonic() + timeout
    while sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
        msg = parse_control(sock.recv_multipart(), CLIENT_TAG, ClientCommand)
        if msg.command == ClientCommand.ERROR.value and msg.request_id == request_id:
            return msg
    return None


@pytest.mark.parametrize("kind", CLIENT_KINDS, ids=lambda k: k.name)
def test_every_kind_over_its_frame_limit_is_answered_bad_request(cluster, kind):
    """Issue 39 item 4 (docs/failure-semantics.md): a client's message with more frames than its kind may have
    is refused unread and answered bad_request under its request id, for each kind, one frame over the limit
    or 150,000 over (whole within the connection's bound); the answer leaves before the connection is cut."""
    head = [CLIENT_TAG, kind.value, b"default"]
    limit = frame_limit(head, PART_FRAMES)
    ctx = zmq.Context.instance()
    for count in (limit + 1, 150_000):
        request_id = uuid.uuid4().bytes
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        try:
            sock.connect(cluster.frontend)
            sock.send_multipart([*head, request_id, b"{}", *[b""] * (count - CONTROL_FRAMES)])
            error = _error_for(sock, request_id)
        finally:
            sock.close()
        assert error is not None, f"{kind.name} of {count} frames: no answer"
        assert error.header["code"] == "bad_request" and f"more than {limit} frames" in error.header["error"]


def test_a_message_cut_before_it_is_whole_is_answered_first(cluster):
    """Issue 39 item 4: a client that spoke before sends a message that never ends (empty frames, 1.6 MB/s):
    the broker cannot read it, so it cuts the connection at its bound, but tells it why first (bad_request,
    no request id: that message's was never read); its STATUS was answered before."""
    peer = RawZmtpPeer(cluster.frontend)
    try:
        peer.send([CLIENT_TAG, ClientCommand.STATUS.value, b"default", uuid.uuid4().bytes, b"{}"])
        cut = peer.slow_frames([CLIENT_TAG, ClientCommand.REQUEST.value, b"default", uuid.uuid4().bytes,
                                b'{"reply_to":"tcp://127.0.0.1:9"}'], per_step=8192, step_s=0.01, timeout=60)
        messages = peer.messages(timeout=5)
    finally:
        peer.close()
    commands = [m[1] for m in messages if len(m) >= 5 and m[0] == CLIENT_TAG]
    errors = [json.loads(m[4]) for m in messages if len(m) >= 5 and m[1] == ClientCommand.ERROR.value]
    assert cut and ClientCommand.STATUS.value in commands, commands
    assert [e["code"] for e in errors] == ["bad_request"] and "connection cut" in errors[0]["error"], errors


def test_never_ending_message_to_a_client_data_socket_is_cut_off(cluster, tiny_target_dir):
    """A client's data socket takes at most the replies it waits for: a stranger pushing one endless
    message is cut off, the client's memory stays flat, and its next batch is served."""
    proc = subprocess.Popen([sys.executable, str(HERE / "cluster_util.py"), "idle-client", cluster.frontend,
                             str(tiny_target_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **cluster.env})
    try:
        data = json.loads(proc.stdout.readline())["data"]
        first = [DATA_TAG, Status.OK.value, uuid.uuid4().bytes, b"{}"]
        sent, grew = _flood(proc.pid, data, first, socket_type=b"PUSH")
        print(f"\nclient data socket: cut off after {sent >> 20} of {FLOOD >> 20} MiB; client peak RSS "
              f"+{grew >> 20} MiB")
        assert sent < FLOOD and grew < PEAK_BOUND
        proc.stdin.write("go\n")
        proc.stdin.flush()
        after = json.loads(proc.stdout.readline())
    finally:
        proc.stdin.close()
        proc.wait(30)
    print(f"next batch {after['shape']}, connections dropped {after['dropped']}")
    assert after["shape"][:2] == [2, 16] and after["dropped"] >= 1


def test_reply_of_many_frames_is_refused_by_the_client(cluster, tiny_target_dir):
    """A stranger pushes a client's data socket one whole message of 60,000 empty frames (a reply has a
    handful): the client refuses it by its frame count without building them, cuts that connection, its
    memory stays flat, and its next batches are served."""
    proc = subprocess.Popen([sys.executable, str(HERE / "cluster_util.py"), "idle-client", cluster.frontend,
                             str(tiny_target_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **cluster.env})
    try:
        data = json.loads(proc.stdout.readline())["data"]
        reset_peak_rss(proc.pid)
        before = peak_rss_kib(proc.pid) << 10
        peer = RawZmtpPeer(data, b"PUSH")
        try:
            peer.many_frames([DATA_TAG, Status.OK.value, uuid.uuid4().bytes, b"{}"], FRAMES_WHOLE)
            for _ in range(20):  # batches until the refusal is counted (the I/O thread reads in its own time)
                proc.stdin.write("go\n")
                proc.stdin.flush()
                after = json.loads(proc.stdout.readline())
                if after["refused_messages"]:
                    break
        finally:
            peer.close()
        grew = (peak_rss_kib(proc.pid) << 10) - before
    finally:
        proc.stdin.close()
        proc.wait(30)
    print(f"\nclient data socket: {FRAMES_WHOLE} frames refused unread ({after['refused_messages']}), connections "
          f"cut {after['dropped']}; next batch {after['shape']}; client peak RSS +{grew >> 20} MiB")
    assert after["refused_messages"] == 1 and after["dropped"] >= 1
    assert after["shape"][:2] == [2, 16] and grew < 32 << 20


def test_broker_message_of_many_frames_is_refused_by_the_worker(tiny_target_dir, tmp_path):
    """A worker hears only its broker; one that sends it a message of 60,000 empty frames (its messages have
    5 and a payload's parts) is refused unread: the worker logs it, cuts that connection, keeps its memory
    flat, and registers again."""
    ctx = zmq.Context()
    broker = ctx.socket(zmq.ROUTER)
    broker.setsockopt(zmq.LINGER, 0)
    port = broker.bind_to_random_port("tcp://127.0.0.1")
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        worker = zygote.popen(["-m", "spec_serve.tools.cli", "worker", "--target", str(tiny_target_dir), "--device",
                               "cpu", "--broker", f"tcp://127.0.0.1:{port}"],
                              {**os.environ, **FAST_ENV, "OMP_NUM_THREADS": "1"}, out)
    try:
        def ready():  # the worker's next READY (its registration); its broker check (a heartbeat) answered
            while broker.poll(120_000):
                frames = broker.recv_multipart()
                if frames[2] == WorkerCommand.READY.value:
                    return frames[0]
                if frames[2] == WorkerCommand.HEARTBEAT.value:  # as a broker that does not know it: register
                    broker.send_multipart([frames[0], *control(WORKER_TAG, WorkerCommand.DISCONNECT.value)])
            raise TimeoutError("the worker never sent READY")

        identity = ready()
        reset_peak_rss(worker.pid)
        before = peak_rss_kib(worker.pid) << 10
        broker.send_multipart([identity, *control(WORKER_TAG, WorkerCommand.HEARTBEAT.value),
                               *([b""] * FRAMES_WHOLE)])
        wait_until(lambda: "worker.refused_message" in log.read_text(), 60, what="the worker refusing it")
        again = ready()  # cut off, it connects again and registers anew
        grew = (peak_rss_kib(worker.pid) << 10) - before
    finally:
        worker.terminate()
        worker.wait(30)
        ctx.destroy(0)
    line = next(ln for ln in log.read_text().splitlines() if "worker.refused_message" in ln)
    print(f"\nworker: {line.split('WARNING', 1)[-1].strip()[:150]}; registered again: {again == identity}; "
          f"worker peak RSS +{grew >> 20} MiB")
    assert again == identity and grew < 32 << 20


def _refusal(sock, size: int, service: str = "nobody-yet") -> str | None:
    """Send one DSpark request of ``size`` payload bytes the way a client does (in parts); the error it got
    (code: message), or None: the broker holds it (it waits for a worker). A STATUS sent after it is answered
    only once the broker handled the request (one connection is read in order)."""
    header = {"op": "generate", "kind": "dspark", "timeout": 60, "reply_to": "tcp://127.0.0.1:9"}
    payload = [bytes(memoryview(f)) for f in wire.encode({"input_ids": torch.zeros(size // 8, dtype=torch.int64)})]
    for part in in_parts(control(CLIENT_TAG, ClientCommand.REQUEST.value, service, uuid.uuid4().bytes, header,
                                 payload)):
        sock.send_multipart(part)
    sock.send_multipart(control(CLIENT_TAG, ClientCommand.STATUS.value, service, uuid.uuid4().bytes))
    error = None
    while sock.poll(30_000):
        frames = sock.recv_multipart()
        if frames[1] == ClientCommand.ERROR.value:
            answer = json.loads(frames[4])
            error = f"{answer['code']}: {answer['error']}"
        elif frames[1] == ClientCommand.STATUS.value:
            return error
    raise TimeoutError("the broker did not answer STATUS")


def test_one_connection_holds_at_most_its_share(tiny_target_dir, tmp_path):
    """Requests that queue (no worker serves them yet): one connection holds at most its share of
    --max-held-bytes and is told to back off past it, while others still get theirs held up to the total;
    a request over --max-request-tokens is refused at its first part, naming the limit. Broker memory stays
    near what it holds, and the ingress watcher cuts none of these clients: their parts, sent back to back,
    wait whole in libzmq while the broker handles the ones before (on a loaded host, for long)."""
    # --client-held-share 0.25: 16 MiB, four requests a connection (each a little under 4 MiB with its header)
    held, size = 64 << 20, (4 << 20) - 4096
    # A long liveness: raw clients send no heartbeats, and their queued requests must stay.
    env = {**FAST_ENV, "SPEC_SERVE_HEARTBEAT_LIVENESS": "600", "SPEC_SERVE_MAX_HELD_BYTES": str(held),
           "SPEC_SERVE_MAX_REQUEST_TOKENS": str(256 << 10)}  # 6 MiB of ids and masks
    with local_cluster(None, workers=0, env=env, log_dir=tmp_path) as c:
        ctx = zmq.Context()
        try:
            socks = [ctx.socket(zmq.DEALER) for _ in range(5)]
            for sock in socks:
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(c.frontend)
            reset_peak_rss(c.broker.pid)
            before = peak_rss_kib(c.broker.pid) << 10
            greedy = [_refusal(socks[0], size) for _ in range(6)]
            others = [_refusal(sock, size) for sock in socks[1:4] for _ in range(4)]
            late = _refusal(socks[4], size)
            oversized = _refusal(socks[4], 8 << 20)
            grew = (peak_rss_kib(c.broker.pid) << 10) - before
        finally:
            ctx.destroy(0)  # closes the sockets: a context collected with open sockets blocks forever
        cut = [line for line in (tmp_path / "broker.log").read_text().splitlines() if "ingress.dropped" in line]
    print(f"\none connection, 6 requests of {size >> 20} MiB: {[r and r[:60] for r in greedy]}\nthree others, 4 "
          f"each: {sum(r is None for r in others)} held; a fifth: {late and late[:90]}\nover the token limit: "
          f"{oversized and oversized[:90]}\nbroker peak RSS +{grew >> 20} MiB (holding {held >> 20} MiB)")
    assert not cut, cut
    assert greedy[:4] == [None] * 4 and all(r and r.startswith("unavailable") and "share" in r for r in greedy[4:])
    assert others == [None] * 12
    assert late and late.startswith("unavailable") and "--max-held-bytes" in late
    assert oversized and oversized.startswith("bad_request") and "exceeds the limit" in oversized
    assert grew < held + PEAK_BOUND


# ------------------------------------------------------------------- replies are not trusted


class FakeWorker(threading.Thread):
    """A fake worker (a hostile or broken peer, not the real thing): registers with the tiny target's info,
    heartbeats, and answers each request with whatever ``reply(request_tensors)`` returns: a list of data
    messages to push to the client (empty: hold the request forever, as a hung worker does)."""

    def __init__(self, cluster, reply, service: str = "default", capacity: int = 2):
        super().__init__(daemon=True)
        self.info = next(w["target_info"] for w in workers(cluster))
        self.cluster, self.reply, self.service, self.capacity = cluster, reply, service, capacity
        self.identity = uuid.uuid4().bytes
        self.requests = 0
        self._stopping = threading.Event()

    def run(self) -> None:
        ctx = zmq.Context()
        broker = ctx.socket(zmq.DEALER)
        broker.setsockopt(zmq.LINGER, 0)
        broker.setsockopt(zmq.IDENTITY, self.identity)
        broker.connect(self.cluster.backend)
        broker.send_multipart(control(WORKER_TAG, WorkerCommand.READY.value, self.service,
                                      header={"target_info": self.info, "capacity": self.capacity}))
        pushes: dict[str, zmq.Socket] = {}
        next_beat = 0.0
        while not self._stopping.is_set():
            if time.monotonic() > next_beat:
                broker.send_multipart(control(WORKER_TAG, WorkerCommand.HEARTBEAT.value))
                next_beat = time.monotonic() + HEARTBEAT_INTERVAL
            if broker.poll(50):
                msg = parse_control(broker.recv_multipart(), WORKER_TAG, WorkerCommand)
                if msg.command == WorkerCommand.REQUEST.value:
                    self._serve(ctx, pushes, broker, msg)
        ctx.destroy(0)

    def _serve(self, ctx, pushes, broker, msg) -> None:
        self.requests += 1
        replies = self.reply(wire.decode(msg.payload))
        if not replies:
            return  # hung: holds the request, keeps heartbeating
        endpoint = msg.header["reply_to"]
        if endpoint not in pushes:
            pushes[endpoint] = ctx.socket(zmq.PUSH)
            pushes[endpoint].setsockopt(zmq.LINGER, 0)
            pushes[endpoint].connect(endpoint)
        for tensors in replies:
            header = {"worker": "fake", "fingerprint": self.info["fingerprint"]}  # no digests: clients verify="off"
            pushes[endpoint].send_multipart(data_message(Status.OK, msg.request_id, header, wire.encode(tensors)))
        broker.send_multipart(control(WORKER_TAG, WorkerCommand.DONE.value, self.service, msg.request_id,
                                      {"status": "ok"}))

    def stop(self) -> None:
        self._stopping.set()
        self.join(10)


def _dspark_reply(info: dict, request: dict) -> dict:
    """Zeros shaped exactly as DESIGN.md's DSpark contract says for this request."""
    rows, seq = request["input_ids"].shape
    hidden, dtype = info["hidden_size"], getattr(torch, info["dtype"])
    return {"target_hidden_states": torch.zeros(rows, seq, len(info["dspark_layer_ids"]) * hidden, dtype=dtype),
            "target_last_hidden_states": torch.zeros(rows, seq, hidden, dtype=dtype),
            "input_ids": torch.zeros(rows, seq, dtype=torch.int64),
            "loss_mask": torch.zeros(rows, seq, dtype=request["loss_mask"].dtype)}


BROKEN_REPLIES = {
    "a row too many": lambda t: {**t, "target_hidden_states": torch.zeros(t["target_hidden_states"].shape[0] + 1,
                                                                          *t["target_hidden_states"].shape[1:])},
    "another dtype": lambda t: {**t, "target_last_hidden_states": t["target_last_hidden_states"].double()},
    "a tensor missing": lambda t: {k: v for k, v in t.items() if k != "loss_mask"},
    "an extra tensor": lambda t: {**t, "junk": torch.zeros(3)},
    "zero bytes, 2^38 wide": lambda t: {**t, "target_hidden_states": torch.zeros(0, 1 << 38)},
}


@pytest.mark.parametrize("broken", list(BROKEN_REPLIES))
def test_reply_that_breaks_the_contract_is_refused(cluster, tiny_target_dir, broken):
    """A worker's reply whose names, dtypes or shapes are not the contract's for the rows asked is refused
    before anything is allocated for it: the batch fails with the reason, never returns the bad tensors."""
    fake = FakeWorker(cluster, lambda req: [BROKEN_REPLIES[broken](_dspark_reply(fake.info, req))], service="forged")
    fake.start()
    try:
        with RemoteTargetModel(cluster.frontend, service="forged", timeout=10, max_retries=1, num_shards=2,
                               verify="off", **CLIENT_KW) as client:
            with pytest.raises(Exception, match="breaks the contract") as raised:
                client.generate_batch(*sample_batch(tiny_target_dir, 2, 16, seed=2), kind="dspark")
            print(f"\n{broken}: {type(raised.value).__name__}: {str(raised.value)[:160]}")
            assert client.stats.contract_violations >= 2  # one per attempt
    finally:
        fake.stop()


def test_claimed_capacity_is_capped(cluster):
    """A worker claiming a capacity of 10^6 is counted at the broker's cap, so it cannot draw the queue."""
    fake = FakeWorker(cluster, lambda req: [], service="greedy", capacity=10**6)
    fake.start()
    try:
        claimed = wait_until(lambda: [w for w in workers(cluster, "greedy")], 30, what="the fake registering")
        print(f"\nclaimed capacity 10^6, the broker counts {claimed[0]['capacity']}")
    finally:
        fake.stop()
    from spec_serve.broker.workers import MAX_WORKER_CAPACITY

    assert claimed[0]["capacity"] == MAX_WORKER_CAPACITY


def test_reply_to_an_unknown_request_is_unknown_not_duplicate(cluster, tiny_target_dir):
    fake = FakeWorker(cluster, lambda req: [_dspark_reply(fake.info, req)] * 2, service="twice")
    fake.start()
    try:
        with RemoteTargetModel(cluster.frontend, service="twice", timeout=10, verify="off", **CLIENT_KW) as client:
            out = client.generate_batch(*sample_batch(tiny_target_dir, 2, 16, seed=3), kind="dspark")
            push = zmq.Context.instance().socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(client._io.data_endpoint)
            push.send_multipart(data_message(Status.OK, uuid.uuid4().bytes, {"worker": "nobody"}))
            wait_until(lambda: client.stats.unknown + client.stats.duplicates >= 2, 10, what="both strays counted")
            push.close(0)
            stats = client.stats
    finally:
        fake.stop()
    print(f"\nsecond reply to an answered request: duplicates={stats.duplicates}; a reply to an id never sent: "
          f"unknown={stats.unknown}")
    assert out["target_hidden_states"].shape[:2] == (2, 16)
    assert stats.duplicates == 1 and stats.unknown == 1


def test_hung_worker_misses_the_deadline_and_its_requests_move(cluster, tiny_target_dir, reference):
    """A worker that takes requests and never answers (still heartbeating) is dead for each of them at
    its deadline: the broker gives them to another worker, and every batch is served, bit-equal."""
    fake = FakeWorker(cluster, lambda req: [], capacity=8)
    fake.start()
    try:
        wait_until(lambda: len(workers(cluster, "default")) == 2, 30, what="the hung fake registering")
        # Frames only: a request that offers the same-host plane is near this host, and the broker's ranking
        # would keep it on the real worker (whose READY names this host), never on the hung fake.
        with RemoteTargetModel(cluster.frontend, timeout=4, max_retries=1, same_host_plane=False,
                               **CLIENT_KW) as client:
            got = [client.generate_batch(*reference.batch(seed), kind="dspark") for seed in range(4)]
        verified = sum(same(g, reference.expected(seed, kind="dspark")) for seed, g in enumerate(got))
        print(f"\nhung worker took {fake.requests} of the requests; {verified}/4 verified")
        assert fake.requests >= 1 and verified == 4
    finally:
        fake.stop()
        wait_until(lambda: len(workers(cluster, "default")) == 1, 30, what="the fake leaving")


# ------------------------------------------------------------------------ the HTTP shim

TRICKLERS = 200
SHIM_CONNECTIONS = 32  # transport/http_shim.py MAX_CONNECTIONS
SHIM_DEADLINE_S = 5.0  # transport/http_shim.py REQUEST_DEADLINE_S


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_http_shim_cannot_be_starved(cluster):
    """A slowloris: 200 connections that each send a byte now and then and never finish a request. The
    broker's descriptors and threads stay bounded, /health still answers at once, a new ZeroMQ client is
    served, and every trickling connection is cut by the whole-request deadline."""
    pid = cluster.broker.pid
    fds_before, threads_before = _open_fds(pid), len(os.listdir(f"/proc/{pid}/task"))
    tricklers = []
    for _ in range(TRICKLERS):
        sock = socket.create_connection(("127.0.0.1", cluster.http_port), timeout=5)
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        tricklers.append(sock)
    time.sleep(1.0)
    fds_during, threads_during = _open_fds(pid), len(os.listdir(f"/proc/{pid}/task"))
    start = time.monotonic()
    code, body = cluster.get("/health")  # liveness: the broker's loop turns
    health_s = time.monotonic() - start
    with RemoteTargetModel(cluster.frontend, timeout=30, **CLIENT_KW) as client:
        assert client.status()["workers"]
    open_after = _trickle_until_closed(tricklers, SHIM_DEADLINE_S + 5)
    print(f"\nslowloris of {TRICKLERS}: broker fds {fds_before} -> {fds_during}, threads {threads_before} -> "
          f"{threads_during}; /health {code} in {health_s:.2f}s; still open after the deadline: {open_after}")
    assert fds_during - fds_before <= SHIM_CONNECTIONS + 2
    assert threads_during - threads_before <= 2
    assert code == 200 and body["status"] == "ok" and health_s < 5
    assert open_after == 0


def _trickle_until_closed(socks: list, seconds: float) -> int:
    """Send a header byte on each open connection every 0.5 s until all are closed or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    open_socks = list(socks)
    while open_socks and time.monotonic() < deadline:
        still = []
        for sock in open_socks:
            try:
                sock.setblocking(False)
                try:
                    if sock.recv(1) == b"":
                        raise ConnectionResetError  # closed by the shim (EOF)
                except BlockingIOError:
                    pass
                sock.send(b"X")
                still.append(sock)
            except OSError:
                sock.close()
        open_socks = still
        time.sleep(0.5)
    for sock in open_socks:
        sock.close()
    return len(open_socks)
