"""Each reply path on its own, through the ``ReplyPath`` interface (spec_serve/paths/base.py), on CPU: a
path's worker half delivers a reply, its client half accepts it, the bytes are the engine's, and what the
path lent is given back and released. Frames; the same-host plane (shared memory); NCCL (gloo: a real pair
group between the two halves, in one process); and spool, a fourth path that lives only in the tests
(tests/extra_paths/spool), which also runs end to end: put first in the registry's order, a real broker,
worker and client use it with no other change.

The client halves talk to a ``RecordingPort`` instead of the client's I/O thread (which the cluster tests
run for real): it runs ``call`` at once and records what a path resolves and falls back.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import pathlib
import re
import threading
import time
import types
import uuid

import pytest
import torch

from cluster_util import CLIENT_KW, Reference, assert_equal_batches
from extra_paths.spool import SpoolPath
from spec_serve.client.api import RemoteTargetModel
from spec_serve.client.assembly import materialize
from spec_serve.paths import base, registry
from spec_serve.paths.faults import Faults
from spec_serve.paths.frames import FramesPath
from spec_serve.paths.frames.hostpool import HostBufferPool
from spec_serve.paths.nccl import NcclPath
from spec_serve.paths.plane import PlanePath, shm
from spec_serve.protocol.commands import ClientCommand, Status
from spec_serve.protocol.messages import Reply, SupervisionRequest, WorkerBind
from spec_serve.tools.launch import local_cluster
from spec_serve.worker.server import Worker

REPLY_TO = "tcp://127.0.0.1:1"


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"aux_hidden_states": torch.randn(2, 8, 48, generator=g).to(torch.bfloat16),
            "target_probs": torch.rand(2, 8, 5, generator=g), "position_mask": torch.rand(2, 8, 1, generator=g) > .5,
            "input_ids": torch.randint(0, 99, (2, 8), generator=g), "loss_mask": torch.ones(2, 8, dtype=torch.int64)}


class RecordingPort:
    """``paths.base.ClientPort`` for a client half on its own: ``call`` runs at once; resolves and fallbacks
    are recorded; ``submit`` answers a BIND through ``on_bind``."""

    def __init__(self) -> None:
        self.data_endpoint, self.data_key, self.local_host = REPLY_TO, None, "127.0.0.1"
        self.resolved: dict[bytes, dict[str, torch.Tensor]] = {}
        self.fallbacks: list[tuple[bytes, str, str]] = []
        self.controls: list[list] = []
        self.arrived = threading.Event()
        self.on_bind = None  # (header) -> future of the answer

    def call(self, fn) -> None:
        fn()

    def send_control(self, frames: list) -> None:
        self.controls.append(frames)

    def submit(self, command, service, header, payload, timeout, max_retries=None) -> concurrent.futures.Future:
        assert command is ClientCommand.BIND and self.on_bind is not None
        return self.on_bind(header)

    def resolve(self, request_id: bytes, reply: Reply, tensors: dict, path: str) -> None:
        self.resolved[request_id] = tensors
        self.arrived.set()

    def fallback(self, request_id: bytes, path: str, reason: str) -> None:
        self.fallbacks.append((request_id, path, reason))
        self.arrived.set()


def _setups(port: RecordingPort, **options) -> tuple[base.WorkerSetup, base.ClientSetup]:
    worker = base.WorkerSetup("w0", torch.device("cpu"), "tcp://127.0.0.1:2", "127.0.0.1", None, Faults(),
                              HostBufferPool(max_buffers=1, copy_host_tensors=True), None, 1, 60.0)
    return worker, base.ClientSetup(port, "default", torch.device("cpu"), options)


def _round_trip(worker: base.WorkerSide, client: base.ClientSide, request: SupervisionRequest,
                tensors: dict[str, torch.Tensor]) -> tuple[base.Outgoing, dict[str, torch.Tensor]]:
    """One reply through the two halves: delivered, its header sent as JSON, accepted, copied out, settled."""
    assert worker.takes(request)
    request_id = uuid.uuid4().bytes
    (outgoing,) = worker.deliver([base.Delivery(request_id, request, tensors, Reply(worker="w0"))])
    assert outgoing is not None and outgoing.via
    header = outgoing.reply.to_json()
    reply = Reply.from_json(header)
    assert client.carries(reply)
    got = client.accept(base.Arrival(request_id, reply, header, list(outgoing.frames), None, 1 << 30,
                                     lambda reason: pytest.fail(f"asked again: {reason}")))
    assert got is not None
    landed = materialize(got, torch.device("cpu"))
    landed = {k: v.clone() for k, v in landed.items()}  # out of whatever memory the path lent
    assert base.settle(got) is None
    if outgoing.loan is not None:
        outgoing.loan.left()
    return outgoing, landed


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_frames_on_its_own():
    port = RecordingPort()
    worker_setup, client_setup = _setups(port)
    worker, client = FramesPath.worker(worker_setup), FramesPath.client(client_setup)
    request = SupervisionRequest(reply_to=REPLY_TO)
    outgoing, landed = _round_trip(worker, client, request, _tensors(1))
    _assert_same(landed, _tensors(1))
    assert outgoing.via == "frames" and not worker.local(request)
    pool = worker_setup.host_pool
    assert pool.stats()["lent"] == 0 and pool.allocations == 1  # the slab went back once the reply left
    _, again = _round_trip(worker, client, request, _tensors(2))
    _assert_same(again, _tensors(2))
    assert pool.allocations == 1  # and was lent again


def _segments() -> set[str]:
    return {n for n in os.listdir(shm.SHM_DIR) if (o := shm.owner_of(n)) is not None and o.pid == os.getpid()}


def _offered(side: base.ClientSide, op: str = "generate", **fields) -> SupervisionRequest:
    """A request of ``op`` carrying what ``side`` offers, as the client builds it (ClientPaths.offer)."""
    offer = side.offer(op)
    assert offer is not None
    return SupervisionRequest(reply_to=REPLY_TO, op=op, pin=offer.pin,
                              offers={side.name: offer.body} if offer.body is not None else None, **fields)


def test_plane_on_its_own():
    port = RecordingPort()
    worker_setup, client_setup = _setups(port, same_host_plane=True)
    worker, client = PlanePath.worker(worker_setup), PlanePath.client(client_setup)
    request = _offered(client)
    assert not worker.takes(request)  # not started: no slots
    worker.start()
    try:
        assert client.offer("embeddings") is None and worker.local(request)
        outgoing, landed = _round_trip(worker, client, request, _tensors(3))
        _assert_same(landed, _tensors(3))
        assert outgoing.via == "shm" and outgoing.lent_bytes > 0 and len(outgoing.frames) == 1
        assert worker.plane.ctl.acked(0)  # settled: the slot is the worker's again
        held = worker.deliver([base.Delivery(b"x" * 16, request, _tensors(4), Reply(worker="w0"))])[0]
        busy = worker.deliver([base.Delivery(b"y" * 16, request, _tensors(5), Reply(worker="w0"))])[0]
        assert held is not None and busy is None  # one slot, lent: the next path must carry that one
        held.loan.dropped()  # undeliverable: the slot comes back at once
        assert worker.plane.ctl.acked(0)
        assert _segments()
    finally:
        worker.close()
        client.stop()
    assert not _segments() and worker.plane is None  # close unlinked every segment


def _bound(port: RecordingPort, worker: base.WorkerSide) -> tuple[list[tuple], list[threading.Thread]]:
    """Answer the client half's BIND with the worker half's control job (on a thread: it forms the group,
    as the worker's compute thread would, before it takes the next request)."""
    posted: list[tuple] = []
    threads: list[threading.Thread] = []

    def on_bind(header) -> concurrent.futures.Future:
        answer: concurrent.futures.Future = concurrent.futures.Future()

        def post(status, grant) -> None:
            posted.append((status, grant))
            answer.set_result(types.SimpleNamespace(header=grant))

        bind = WorkerBind(client="c0ffee", reply_to=header.reply_to, prefix=uuid.uuid4().hex, timeout=header.timeout,
                          device_type=header.device_type)
        threads.append(threading.Thread(target=worker.control, args=("bind", bind, post), daemon=True))
        threads[-1].start()
        return answer

    port.on_bind = on_bind
    return posted, threads


def test_nccl_on_its_own_over_gloo():
    port = RecordingPort()
    worker_setup, client_setup = _setups(port, enable_nccl=True, nccl_timeout=30)
    worker, client = NcclPath.worker(worker_setup), NcclPath.client(client_setup)
    posted, control = _bound(port, worker)
    try:
        request = _offered(client, client="c0ffee")  # binds: the pair group forms between the two halves
        control[0].join(30)
        assert request.pin == "w0" and request.offer("nccl") is not None and posted[0][0] is Status.OK
        assert worker.takes(request) and worker.local(request)  # same host key
        assert client.offer("embeddings") == base.Offer(pin="w0")  # other ops: our worker too, as frames
        assert client.holds() == "w0" and client.may_hold
        with pytest.raises(base.PathUnavailable):
            worker.takes(dataclasses.replace(request, client="another"))
        request_id = uuid.uuid4().bytes
        (outgoing,) = worker.deliver([base.Delivery(request_id, request, _tensors(6), Reply(worker="w0"))])
        assert outgoing.frames == [] and outgoing.via == "nccl" and outgoing.after_post is not None
        reply = Reply.from_json(outgoing.reply.to_json())
        assert client.carries(reply) and client.tensors_follow
        assert client.accept(base.Arrival(request_id, reply, {}, [], None, 1 << 30, pytest.fail)) is None
        outgoing.after_post()  # the tensors over the pair group, received on the client's pair thread
        assert port.arrived.wait(30) and not port.fallbacks
        _assert_same(port.resolved[request_id], _tensors(6))
        again = client.without(request)
        assert again.offers is None and again.pin is None and client.pins(request) and not client.pins(again)
    finally:
        worker.close()
        client.close()
    assert worker._pair is None and worker.prefix is None  # the group is closed
    assert port.controls  # the client sent RELEASE


def test_nccl_reply_without_a_binding_falls_back():
    port = RecordingPort()
    _, client_setup = _setups(port)  # enable_nccl off: nothing offered
    client = NcclPath.client(client_setup)
    assert client.offer("generate") is None
    reply = Reply(worker="w9", path={"nccl": {"pair": "p", "specs": [["x", [1], "float32"]]}})
    client.accept(base.Arrival(b"r" * 16, reply, {}, [], None, 1 << 30, pytest.fail))
    assert port.fallbacks == [(b"r" * 16, "nccl", "nccl reply from worker w9 without a live binding")]


def test_spool_on_its_own():
    port = RecordingPort()
    worker_setup, client_setup = _setups(port)
    worker, client = SpoolPath.worker(worker_setup), SpoolPath.client(client_setup)
    try:
        request = _offered(client)
        outgoing, landed = _round_trip(worker, client, request, _tensors(7))
        _assert_same(landed, _tensors(7))
        assert outgoing.via == "spool" and not any(client.dir.iterdir())  # read, then deleted
        dropped = worker.deliver([base.Delivery(b"z" * 16, request, _tensors(8), Reply(worker="w0"))])[0]
        assert any(client.dir.iterdir())
        dropped.loan.dropped()
        assert not any(client.dir.iterdir())
        assert not worker.takes(client.without(request))
    finally:
        worker.close()
        client.stop()
    assert not client.dir.exists()


def test_the_order_decides_and_a_path_that_cannot_deliver_hands_on():
    """The first path of the order that takes a reply carries it; one that cannot deliver it after all (the
    plane, its only slot lent) hands it to the next that takes it (frames)."""
    port = RecordingPort()
    worker_setup, client_setup = _setups(port, same_host_plane=True)
    paths = registry.WorkerPaths(worker_setup, (SpoolPath, PlanePath, FramesPath))
    clients = registry.ClientPaths(client_setup, (SpoolPath, PlanePath, FramesPath))
    paths.start()
    try:
        assert [s.name for s in paths.sides] == ["spool", "plane", "frames"]
        assert list(clients.offer("generate").offers) == ["spool"]  # the first path that offers
        request = _offered(clients.named("plane"))
        route = paths.route(request)
        assert route.side.name == "plane"  # spool does not take it (no spool offer)
        items = [base.Delivery(bytes([i]) * 16, request, _tensors(i), Reply(worker="w0")) for i in range(2)]
        first, second = paths.deliver([route, route], items)
        assert (first.via, second.via) == ("shm", "frames")
        assert paths.route(SupervisionRequest(reply_to=REPLY_TO, op="embeddings")).side.name == "frames"
        for outgoing in (first, second):
            outgoing.loan.dropped()
    finally:
        paths.close()
        clients.stop()
    assert not _segments()


@pytest.fixture(scope="module")
def broker():
    with local_cluster(workers=0) as c:
        yield c


def test_spool_end_to_end_from_one_registry_line(broker, tiny_target_dir, tiny_vocab_mapping, monkeypatch):
    """The fourth path first in the order (the registry line), a real broker, worker and client: every reply
    comes by spool, equal to the colocated forward, and no file is left."""
    from spec_serve.engines.hf import HFTarget

    monkeypatch.setattr(registry, "PATHS", ("extra_paths.spool:SpoolPath", *registry.PATHS))
    worker = Worker(HFTarget(tiny_target_dir), broker.backend, service="spool")
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    reference = Reference(tiny_target_dir, tiny_vocab_mapping)
    try:
        with RemoteTargetModel(broker.frontend, service="spool", timeout=60, num_shards=2, **CLIENT_KW) as client:
            client.set_vocab_mapping(*tiny_vocab_mapping)
            spool_dir = client._paths.named("spool").dir
            for seed in range(3):
                assert_equal_batches(client.generate_batch(*reference.batch(seed), kind="eagle3"),
                                     reference.expected(seed, shards=2))  # each shard's rows alone
            assert client.stats.replies["spool"] == 6 and client.stats.replies["frames"] == 0
            assert not any(spool_dir.iterdir())
            deadline = time.monotonic() + 10
            while worker.outbox.replies["spool"] < 6 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert worker.outbox.replies["spool"] == 6  # DONE said via=spool
    finally:
        worker.stop()
        thread.join(30)
    assert not spool_dir.exists()  # the client's stop removed its directory


def test_protocol_and_broker_name_no_path():
    """Adding a path touches no file of protocol/ or broker/: they name none of the paths, so a path's
    fields ride the shared messages opaquely (``offers``, ``path``) and the broker routes by ``pin`` alone."""
    root = pathlib.Path(registry.__file__).resolve().parents[1]
    names = re.compile(r"\b(nccl|plane|spool|samehost|frames path)\b", re.IGNORECASE)
    files = [path for folder in ("protocol", "broker") for path in sorted((root / folder).glob("*.py"))]
    named = [f"{path.relative_to(root)}:{n}" for path in files
             for n, line in enumerate(path.read_text().splitlines(), 1) if names.search(line)]
    assert named == []
