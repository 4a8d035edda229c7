"""Transport scenarios: the same reply bytes over raw ZeroMQ, the codec, a plain ROUTER and the broker (a null
engine), and the worker's hot path in-process."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spec_serve.tools.bench.batches import _nbytes, make_batch, worker_threads
from spec_serve.tools.bench.checks import _figure, verified
from spec_serve.tools.bench.helpers import _spawn_helper

if TYPE_CHECKING:
    from spec_serve.tools.bench.context import Context


def run_push(ctx: Context, mode: str, transport: str = "tcp") -> dict[str, Any]:
    import zmq

    from spec_serve.paths.frames.hostpool import RecyclingAllocator
    from spec_serve.protocol import wire
    from spec_serve.transport.sockets import make_socket

    cfg = ctx.cfg
    alloc = RecyclingAllocator()  # as the client's I/O thread decodes
    zctx: zmq.SyncContext = zmq.Context.instance()
    bind = "tcp://127.0.0.1:*" if transport == "tcp" else f"ipc://{ctx.tmp}/push.sock"
    pull = make_socket(zctx, zmq.PULL, bind=bind, hwm=4)
    endpoint = pull.getsockopt_string(zmq.LAST_ENDPOINT)
    count = cfg.transport_messages + 1
    proc = _spawn_helper("_push_sender", endpoint, mode, count, 1, cfg.transport_seq)
    try:
        nbytes = 0
        pull.recv_multipart(copy=False)  # the first message pays connection set-up
        start = time.perf_counter()
        while True:
            frames = pull.recv_multipart(copy=False)
            if len(frames) == 1 and len(frames[0]) == 0:
                break
            if mode == "raw":
                nbytes += sum(len(f) for f in frames)
            else:
                nbytes += _nbytes(wire.decode(frames, alloc=alloc if ctx.recycle else None))
        seconds = time.perf_counter() - start
    finally:
        proc.wait(30)
        pull.close(0)
    name = ("zmq_raw" if mode == "raw" else "frames") + ("" if transport == "tcp" else f"_{transport}")
    return _figure(name, 0, nbytes, seconds, messages=cfg.transport_messages)


def run_direct(ctx: Context) -> dict[str, Any]:
    import zmq

    from spec_serve.protocol import wire
    from spec_serve.protocol.commands import new_request_id, parse_data
    from spec_serve.transport.sockets import make_socket

    cfg = ctx.cfg
    endpoint_file = Path(ctx.tmp) / "direct.endpoint"
    proc = _spawn_helper("_direct_server", endpoint_file, 1, cfg.transport_seq)
    deadline = time.monotonic() + 120
    while not endpoint_file.exists() or not endpoint_file.read_text():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("direct server did not start")
        time.sleep(0.05)
    dealer = make_socket(zmq.Context.instance(), zmq.DEALER, connect=endpoint_file.read_text())
    request = wire.encode(dict(zip(("input_ids", "attention_mask", "loss_mask"),
                                   make_batch(1, cfg.transport_seq, 2, 0))))
    try:
        def one_round(n: int) -> int:
            got, received, inflight, sent = 0, 0, 0, 0
            while received < n:
                while inflight < cfg.prefetch and sent < n:
                    dealer.send_multipart([new_request_id(), *request], copy=False)
                    inflight, sent = inflight + 1, sent + 1
                _, _, _, payload = parse_data(dealer.recv_multipart(copy=False))
                got += _nbytes(wire.decode(payload))
                received, inflight = received + 1, inflight - 1
            return got

        one_round(cfg.warmup or 1)
        start = time.perf_counter()
        nbytes = one_round(cfg.transport_messages)
        seconds = time.perf_counter() - start
        dealer.send(b"stop")
    finally:
        dealer.close(0)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    tokens = cfg.transport_messages * cfg.transport_seq
    return _figure("direct_null", tokens, nbytes, seconds)


def transport_run(frontend: str, kind: str, messages: int, seq: int, prefetch: int, warmup: int,
                  plane: bool = False, service: str = "null") -> dict[str, Any]:
    """Transport only: ``messages`` requests of 1 x ``seq`` tokens to the null worker (8B-shaped replies of
    ``kind``: "eagle3" full, or "eagle3_compact", what compact="auto" sends across hosts, landed and not
    expanded), ``prefetch`` in flight; as frames, or (``plane``) lent through the same-host plane. Every
    reply is checked against what the null engine answers once the clock stopped."""
    from spec_serve.client.api import RemoteTargetModel
    from spec_serve.tools.null_engine import VOCAB, null_mapping, null_tensors
    from spec_serve.tools.verify import mismatch

    with RemoteTargetModel(frontend, service=service, prefetch_depth=prefetch, timeout=600, compact=False,
                           same_host_plane=plane, wire_dtype="auto") as client:
        client.set_vocab_mapping(*null_mapping())
        batch = make_batch(1, seq, VOCAB, 0)
        for _ in range(warmup or 1):
            client.generate_batch(*batch, kind=kind)
        start = time.perf_counter()
        futures = [client.generate_batch_async(*batch, kind=kind) for _ in range(messages)]
        nbytes = sum(_nbytes(f.result()) for f in futures)
        seconds = time.perf_counter() - start
        stats = client.stats
    want = null_tensors(1, seq, kind)
    return {"tokens": messages * seq, "bytes": nbytes, "seconds": seconds, "plane_replies": stats.plane_replies,
            **verified(sum(mismatch(f.result(), want) is None for f in futures), len(futures))}


def run_broker_null(ctx: Context, plane: bool = False, compact: bool = False) -> dict[str, Any]:
    """Transport only through the broker (``transport_run``): full EAGLE-3 replies, or compact ones."""
    cfg = ctx.cfg
    got = transport_run(ctx.frontend, "eagle3_compact" if compact else "eagle3", cfg.transport_messages,
                        cfg.transport_seq, cfg.prefetch, cfg.warmup, plane)
    name = ("samehost_null" if plane else "broker_null") + ("_compact" if compact else "")
    tokens, nbytes, seconds = got.pop("tokens"), got.pop("bytes"), got.pop("seconds")
    return _figure(name, tokens, nbytes, seconds, **got)


def run_worker_pool(ctx: Context) -> dict[str, Any]:
    """The worker's hot path in-process: forward, host copy (pinned pool on a GPU), encode; release as sent."""
    with worker_threads(ctx.device):  # as a worker process runs it
        return _run_worker_pool(ctx)


def _run_worker_pool(ctx: Context) -> dict[str, Any]:
    from spec_serve.protocol import wire
    from spec_serve.worker.server import Job, Worker

    engine = ctx.engine()
    worker = Worker(engine, "tcp://127.0.0.1:1", capacity=2)
    worker.vocab.put("bench", ctx.mapping)
    batch = dict(zip(("input_ids", "attention_mask", "loss_mask"), ctx.batches[0]))
    header = {"op": "generate", "kind": "eagle3", "vocab": "bench", "reply_to": "tcp://127.0.0.1:1"}
    n = max(ctx.cfg.steps, 4)
    start = time.perf_counter()
    for _ in range(n):
        result = worker.serve(Job(bytes(16), header, wire.encode(batch), time.monotonic()))
        if result.out.ready is not None:
            result.out.ready.synchronize()  # the I/O thread sends only once the device->host copy is done
        if result.out.loan is not None:
            result.out.loan.left()  # what the I/O thread does once ZeroMQ has sent the frames
    seconds = time.perf_counter() - start
    pool = worker.host_pool  # None for a CPU engine (no --host-pool): replies borrow its outputs
    return _figure("worker_pool", n * int(batch["attention_mask"].sum()), 0, seconds, messages=n,
                   pool_allocations=pool.stats()["allocations"] if pool else 0, pooled=pool is not None)


def _fresh(ctx: Context) -> dict[str, Any]:
    ctx.recycle = False
    try:
        return run_push(ctx, "wire")
    finally:
        ctx.recycle = True
