"""Memory lent to a transport is never reused before the transport lets go of it (issue 12).

A worker copies each forward's outputs into a pooled host slab and lends views of it to ZeroMQ. It
used to take the slab back once the tracker of the reply's *last* frame was done; pyzmq copies small
frames and gives them a finished tracker, and full EAGLE-3 replies end with the small
``position_mask``: the slab was lent again and overwritten by the next forward while libzmq was
still sending the big frames. On an H200 8 of 9 batches came back wrong, silently.

Here a CPU worker runs that same pooled path (``--host-pool``, frames: the same-host plane is off for
these workers) with a pool of one slab, and the
client is a slow reader: its data socket queues one message (RCVHWM 1) and it reads no reply until
the worker has run every forward it was sent (or waits for its slab), so replies sit half-sent in
the worker's libzmq while later forwards want the slab. Every batch must still equal the colocated
forward of each of its shards, bit for bit.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import zmq

import spec_serve.client.sockets as client_module
from cluster_util import CLIENT_KW, FAST_ENV, assert_equal_batches, stall_replies, workers
from spec_serve.client.api import RemoteTargetModel
from spec_serve.engines import packing
from spec_serve.protocol import wire
from spec_serve.tools.launch import local_cluster
from spec_serve.tools.tiny import sample_batch
from spec_serve.transport.sockets import bound_endpoint, make_socket, send_lent
from spec_serve.worker import replies

# 4 x 512 tokens of full EAGLE-3 on the tiny target (about 5 MB a batch, each shard more than the
# kernel buffers of a stalled reader), its position_mask frame (1 KiB a shard) under pyzmq's copy
# threshold and last.
ROWS, SEQ, BATCHES, PREFETCH = 4, 512, 6, 4
# The reader's stall ends when the worker has computed every request it was sent, or made no progress
# for this long (a correct worker waits for its one slab); the broker's status is refreshed every 0.2 s.
STALL_QUIET_S = 1.5
# Full EAGLE-3 over frames, the largest replies (compact="auto", the default, would send them compact).
FULL_KW = {**CLIENT_KW, "compact": False}


@pytest.fixture(scope="module")
def cluster(tiny_target_dir):
    # Frames only: a same-host worker would lend replies through the same-host plane instead (test_samehost.py).
    with local_cluster(tiny_target_dir, workers=0, env={**FAST_ENV, "SPEC_SERVE_SAME_HOST_PLANE": "0"}) as c:
        pooled = ("--host-pool", "--host-pool-buffers", "1")
        c.start_worker(tiny_target_dir, *pooled, service="pooled")
        c.start_worker(tiny_target_dir, *pooled, "--packing", "--max-batch-tokens", str(ROWS * SEQ), service="packing")
        c.start_worker(tiny_target_dir, "--capacity", "4", service="queued")
        c.wait_workers(3)
        yield c


@pytest.fixture
def slow_reader(monkeypatch):
    """Clients made now queue at most one reply in libzmq (RCVHWM 1), so a stalled reader stalls the
    sender: the rest of a reply stays in the worker's libzmq, borrowing its slab."""
    make_socket = client_module.make_socket

    def one_queued_reply(ctx, kind, **kwargs):
        if kind == zmq.PULL:
            kwargs["hwm"] = 1
        return make_socket(ctx, kind, **kwargs)

    monkeypatch.setattr(client_module, "make_socket", one_queued_reply)


@pytest.fixture(scope="module")
def batches(tiny_target_dir, colocated_target):
    """The test batches and the colocated forward's answer to each."""
    reference = colocated_target()
    inputs = [sample_batch(tiny_target_dir, ROWS, SEQ, seed=seed) for seed in range(BATCHES)]
    return [(batch, reference.generate_batch(*batch, kind="eagle3")) for batch in inputs]


@pytest.fixture(scope="module")
def two_shards(batches, colocated_target):
    """The colocated answer to each test batch as a client with ``num_shards=2`` receives it: each shard's
    rows computed by themselves (the contract, docs/equality.md)."""
    from spec_serve.tools.verify import colocated_reference

    reference = colocated_target()
    return [colocated_reference(reference, batch, "eagle3", shards=2) for batch, _ in batches]


def _completed(cluster, service: str) -> int:
    (worker,) = workers(cluster, service)
    return worker["completed"]


def _wait_until_worker_settles(cluster, service: str, target: int) -> None:
    """Until the worker has completed ``target`` requests (every forward it was sent ran, each into the
    one slab) or stopped making progress (it waits for its slab)."""
    last, quiet_since, deadline = -1, time.monotonic(), time.monotonic() + 60
    while time.monotonic() < deadline:
        done = _completed(cluster, service)
        if done >= target:
            return
        if done != last:
            last, quiet_since = done, time.monotonic()
        elif time.monotonic() - quiet_since > STALL_QUIET_S:
            return
        time.sleep(0.05)


@pytest.mark.parametrize("service,shards", [
    ("pooled", 2),  # tcp loopback
    ("packing", 2),  # the shards of a batch computed in one packed forward: their replies share a slab
])
def test_pooled_replies_survive_slab_reuse(cluster, slow_reader, batches, two_shards, tiny_vocab_mapping, service,
                                          shards):
    # verify="off": the end-to-end digest would catch a reused slab and retry; this test watches the data
    # path itself.
    with RemoteTargetModel(cluster.frontend, service=service, prefetch_depth=PREFETCH, num_shards=shards,
                           timeout=120, verify="off", **FULL_KW) as client:
        client.set_vocab_mapping(*tiny_vocab_mapping)
        stalled = stall_replies(client)
        stalled.set()
        target = _completed(cluster, service) + PREFETCH * shards
        futures = [client.generate_batch_async(*batch, kind="eagle3") for batch, _ in batches[:PREFETCH]]
        _wait_until_worker_settles(cluster, service, target)
        stalled.clear()
        futures += [client.generate_batch_async(*batch, kind="eagle3") for batch, _ in batches[PREFETCH:]]
        results = [f.result(timeout=120) for f in futures]
        assert client.stats.retried == 0 and client.stats.plane_replies == 0
        if service == "packing":
            assert client.stats.batched > 0
    for (batch, _), want, got in zip(batches, two_shards, results):
        if service == "packing":  # a packed forward matches the padded one within a tolerance (docs/packing.md)
            report = packing.compare(got, want, batch[1])
            assert packing.violations(report, packing.TOLERANCE[torch.float32]) == [], report
        else:
            assert_equal_batches(got, want)


def test_replies_past_the_data_sockets_high_water_mark_wait_for_a_slow_reader(cluster, monkeypatch, batches,
                                                                             two_shards, tiny_vocab_mapping):
    """12 replies of about 2.5 MB for one client that reads nothing for longer than CONNECT_GRACE_S (its libzmq
    queues one, its kernel buffer 64 KiB): the worker's socket to it queues DATA_SOCKET_HWM of them, the rest
    wait in the worker and go once the reader reads. Every batch equal to the colocated forward, none retried
    (the worker made the replies past the mark undeliverable before: the client failed after 4 attempts)."""
    make_socket = client_module.make_socket

    def small_buffers(ctx, kind, **kwargs):
        if kind == zmq.PULL:
            kwargs["hwm"] = 1  # libzmq reads one reply ahead of the stalled client
        sock = make_socket(ctx, kind, **kwargs)
        if kind == zmq.PULL:
            sock.setsockopt(zmq.RCVBUF, 64 << 10)  # before the data socket binds
        return sock

    monkeypatch.setattr(client_module, "make_socket", small_buffers)
    with RemoteTargetModel(cluster.frontend, service="queued", prefetch_depth=BATCHES, num_shards=2, timeout=120,
                           **FULL_KW) as client:
        client.set_vocab_mapping(*tiny_vocab_mapping)
        stalled = stall_replies(client)
        stalled.set()
        futures = [client.generate_batch_async(*batch, kind="eagle3") for batch, _ in batches]
        time.sleep(replies.CONNECT_GRACE_S + 1.5)
        stalled.clear()
        results = [f.result(timeout=120) for f in futures]
        assert client.stats.retried == 0 and client.stats.plane_replies == 0
    for want, got in zip(two_shards, results):
        assert_equal_batches(got, want)


def test_send_lent_tracker_waits_for_every_frame():
    """In-process: a message of a large frame then a small one, to a reader that reads nothing yet. The
    last frame's own tracker (pyzmq copied it) is done at once; ``send_lent``'s is done only once libzmq
    has let go of the large frame too."""
    ctx = zmq.Context()
    pull = make_socket(ctx, zmq.PULL, hwm=1)
    pull.setsockopt(zmq.RCVBUF, 64 << 10)  # before bind: the accepted connection's kernel buffer stays small
    pull.bind("tcp://127.0.0.1:*")
    push = make_socket(ctx, zmq.PUSH, connect=bound_endpoint(pull))
    try:
        # 16 MiB in frames of the codec's size, then a small frame.
        big = memoryview(torch.zeros(16 << 20, dtype=torch.uint8).numpy())
        bigs = [big[i : i + wire.MAX_FRAME_BYTES] for i in range(0, big.nbytes, wire.MAX_FRAME_BYTES)]
        small = b"\x01" * 64
        assert push.send_multipart([*bigs, small], copy=False, track=True).done  # the trap: looks sent
        # The reader's libzmq holds one queued and one decoded message, the kernels at most a few MiB more.
        trackers = [send_lent(push, [*bigs, small]) for _ in range(4)]
        time.sleep(0.5)
        assert not trackers[-1].done
        for _ in range(5):
            assert pull.poll(10_000) and len(pull.recv_multipart()) == len(bigs) + 1
        deadline = time.monotonic() + 10
        while not all(t.done for t in trackers) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(t.done for t in trackers)
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()


def test_request_inputs_may_be_refilled_once_submitted(cluster, batches, tiny_vocab_mapping):
    """The request's frames are the client's own copies: a caller that refills its input tensors right
    after ``generate_batch_async`` returns (a reused loader buffer) still gets its batch's answer. Before,
    the frames were views of the caller's tensors, sent later by the I/O thread and again on a retry."""
    (batch, want), (other, _) = batches[0], batches[1]
    with RemoteTargetModel(cluster.frontend, service="pooled", timeout=60, **FULL_KW) as client:
        client.set_vocab_mapping(*tiny_vocab_mapping)
        client.target_info()  # fetched now: generate_batch_async must not wait on the stalled I/O thread
        inputs = tuple(t.clone() for t in batch)
        release = threading.Event()
        client._io.call(release.wait)  # the I/O thread sends nothing until the inputs were refilled
        future = client.generate_batch_async(*inputs, kind="eagle3")
        for buffer, refill in zip(inputs, other):
            buffer.copy_(refill)
        release.set()
        assert_equal_batches(future.result(timeout=60), want)


def test_held_batches_keep_their_receive_buffers(cluster, batches, two_shards, tiny_vocab_mapping):
    """A CPU client assembles sharded replies into recycled buffers (hostpool.RecyclingAllocator): one is
    reused only once no tensor of the batch it held is alive, so a batch a trainer keeps stays intact
    while later batches flow, and dropped ones are recycled."""
    with RemoteTargetModel(cluster.frontend, service="pooled", num_shards=2, prefetch_depth=2, timeout=60,
                           **FULL_KW) as client:
        client.set_vocab_mapping(*tiny_vocab_mapping)
        ((first, _), first_want), rest = (batches[0], two_shards[0]), list(zip(batches[1:], two_shards[1:]))
        held = client.generate_batch(*first, kind="eagle3")
        held_view = held["aux_hidden_states"][1:]  # a view alone keeps the buffer too
        del held
        for _ in range(2):
            for (batch, _), want in rest:
                assert_equal_batches(client.generate_batch(*batch, kind="eagle3"), want)
        assert torch.equal(held_view, first_want["aux_hidden_states"][1:])
        assert client._io.recv_alloc.reuses > 0


# --- GPU ------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_copies_from_recycled_buffers_survive_their_reuse(cluster, batches, two_shards, tiny_vocab_mapping):
    """A CPU client's batch copied to a GPU with ``non_blocking=True`` and dropped at once: its recycled
    buffer is reused by the next batch, and the copy must still hold the first batch's values."""
    with RemoteTargetModel(cluster.frontend, service="pooled", num_shards=2, timeout=60, **FULL_KW) as client:
        client.set_vocab_mapping(*tiny_vocab_mapping)
        copies = []
        for _ in range(2):
            for (batch, _), want in zip(batches, two_shards):
                got = client.generate_batch(*batch, kind="eagle3")
                copies.append(({k: v.to("cuda:0", non_blocking=True) for k, v in got.items()}, want))
                del got
        torch.cuda.synchronize("cuda:0")
        assert client._io.recv_alloc.reuses > 0
    for got, want in copies:
        assert_equal_batches(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_compact_batches_are_complete_when_resolved(tiny_target_dir, tiny_vocab_mapping):
    """The compact expander resolves a batch only once its kernels ran, as frames and NCCL replies are:
    a trainer may read it on any stream."""
    from spec_serve.engines.hf import HFTarget
    from spec_serve.supervision.eagle3 import expand_compact, lm_head_slice

    device = torch.device("cuda:0")
    colocated = HFTarget(tiny_target_dir, device=device, dtype="bfloat16")
    colocated.set_vocab_mapping(*tiny_vocab_mapping)
    head = lm_head_slice(colocated.get_output_embeddings().weight, tiny_vocab_mapping[0])
    side = torch.cuda.Stream(device)
    with local_cluster(tiny_target_dir, workers=1, worker_args=("--device", "cuda:0", "--dtype", "bfloat16")) as c, \
            RemoteTargetModel(c.frontend, device=device, compact=True, timeout=60, **CLIENT_KW) as client:
        client.set_vocab_mapping(*tiny_vocab_mapping)
        for seed in range(3):
            batch = sample_batch(tiny_target_dir, 8, 256, seed=seed)
            got = client.generate_batch(*batch, kind="eagle3")
            assert torch.cuda.current_stream(device).query()  # nothing of this batch is still queued
            with torch.cuda.stream(side):
                read = {k: v.clone() for k, v in got.items()}
            side.synchronize()
            want = expand_compact(colocated.generate_batch(*batch, kind="eagle3_compact"), head, tiny_vocab_mapping[1])
            assert_equal_batches(read, want)
