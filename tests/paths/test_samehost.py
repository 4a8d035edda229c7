"""The same-host data plane (spec_serve/paths/plane/samehost.py) on CPU: shared-memory slots lent between real
processes.

Cluster tests run real broker, worker and (where they are killed) client processes, and compare
every batch with the colocated target bit for bit. That replies came through the plane is shown,
not just counted: the client maps the worker's segments while it reads them, and the worker's
control block shows every slot given back afterwards. Lifetimes: a killed client's slots come back,
a slow client whose slot was lent again never returns those bytes, 32 clients at once, a worker
killed while a client copies; segments and mappings are back to baseline afterwards.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from cluster_util import CLIENT_KW, FAST_ENV, HERE, Reference, assert_equal_batches, kill, rss_kib, wait_until
from spec_serve.client.api import RemoteTargetModel
from spec_serve.engines.hf import HFTarget
from spec_serve.paths.plane import samehost, shm
from spec_serve.protocol import wire
from spec_serve.tools.launch import local_cluster
from spec_serve.tools.tiny import sample_batch
from spec_serve.transport.sockets import local_host_key
from spec_serve.worker.server import Worker

# Services beside "default" (2 workers, plane defaults): few slots, to make lifetimes visible.
TIGHT = ("--plane-slots", "1", "--plane-lease", "1")  # a slot is lent again 1 s after it was lent
HELD = ("--plane-slots", "2", "--plane-lease", "600")  # only an ack or the client's death frees a slot


def _segments(pid: int | None = None) -> set[str]:
    """Plane segments in /dev/shm (of worker ``pid`` only, if given)."""
    names = {n for n in os.listdir(shm.SHM_DIR) if shm.owner_of(n) is not None}
    return {n for n in names if pid is None or shm.owner_of(n).pid == pid}


def _control(pid: int) -> shm.ControlBlock:
    (name,) = [n for n in _segments(pid) if n.endswith(".ctl")]
    return shm.ControlBlock.open(name)


def _lent(ctl: shm.ControlBlock) -> list[int]:
    """Slots lent and not given back."""
    return [i for i in range(ctl.slots) if not ctl.acked(i)]


def _mapped() -> list[str]:
    """Plane segments this process maps now."""
    gc.collect()
    with open("/proc/self/maps") as f:
        return [line for line in f if "/dev/shm/spec-serve." in line]


def _offer(pid: int | None = None, start: int | None = None) -> dict:
    me = shm.Owner.current()
    return {"host": local_host_key(), "pid": pid or me.pid, "start": me.start if start is None else start, "gpus": []}


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"hidden": torch.randn(2, 8, 16, generator=g).to(torch.bfloat16), "probs": torch.rand(2, 8, 5, generator=g),
            "mask": torch.rand(2, 8, 1, generator=g) > 0.5, "ids": torch.randint(0, 99, (2, 8), generator=g)}


def _copy_out(reply: samehost.PlaneReply) -> dict[str, torch.Tensor]:
    return {n: s.copy_into(torch.empty(s.nbytes, dtype=torch.uint8)) for n, s in reply.items()}


def _client_plane(client: RemoteTargetModel) -> samehost.ClientPlane:
    """The client's side of the plane: the memory it maps."""
    return client._paths.named("plane").plane


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture(scope="module")
def cluster(tiny_target_dir):
    with local_cluster(tiny_target_dir, workers=2, env=FAST_ENV) as c:
        c.start_worker(tiny_target_dir, *TIGHT, service="tight")
        c.start_worker(tiny_target_dir, *HELD, service="held")
        c.wait_workers(4)
        yield c
    # Back to baseline: stopped workers unlinked their segments, a killed one's were reaped, and this
    # process (clients, in-process planes) has none.
    assert not any(_segments(pid) for pid in [*(p.pid for p in c.workers), os.getpid()])


@pytest.fixture(scope="module")
def reference(tiny_target_dir, tiny_vocab_mapping):
    return Reference(tiny_target_dir, tiny_vocab_mapping)


# ------------------------------------------------------------------ in-process units


def test_worker_lends_only_to_wellformed_same_host_offers():
    plane = samehost.WorkerPlane(torch.device("cpu"), slots=1, lease_s=60)
    try:
        kind, owner = plane.transport(_offer())
        assert kind == "shm" and owner == shm.Owner.current()  # a CPU worker, or one process: shared memory
        good = _offer()
        refused = [
            {**good, "host": good["host"] + "x"},  # another host or namespace
            {**good, "pid": True}, {**good, "pid": 0}, {**good, "pid": -3}, {**good, "pid": 1 << 40},
            {**good, "pid": "1"}, {**good, "start": -1}, {**good, "start": 1.5}, {**good, "gpus": "GPU-1"},
            {k: v for k, v in good.items() if k != "pid"}, {k: v for k, v in good.items() if k != "host"},
            [good], "plane", 7, None,
        ]
        for bad in refused:
            assert plane.transport(bad) is None, bad
            assert plane.export(bad, _tensors(0), None) is None
        assert plane.transport(None) is None
    finally:
        plane.close()
    assert not _segments(os.getpid())


def test_a_worker_that_never_runs_holds_no_segment(tiny_target_dir):
    """run() owns the plane: building a Worker (as tests and tools do without serving) maps nothing."""
    worker = Worker(HFTarget(tiny_target_dir), "tcp://127.0.0.1:1")
    assert worker.paths.named("plane").plane is None and not _segments(os.getpid())


def test_client_refuses_malformed_descriptors():
    plane = samehost.WorkerPlane(torch.device("cpu"), slots=1, lease_s=60)
    client = samehost.ClientPlane(torch.device("cpu"))
    try:
        export = plane.export(_offer(), _tensors(1), None)
        d = export.descriptor
        other = shm.Owner.current().name("00000000", "s0v1")
        bad = [
            {**d, "kind": "tcp"}, {**d, "slot": 1}, {**d, "slot": -1}, {**d, "gen": 0},
            {**d, "gen": d["gen"] + 1}, {**d, "nbytes": -1}, {**d, "nbytes": 1 << 40}, {**d, "slot": True},
            {**d, "ctl": "../../etc/passwd"}, {**d, "ctl": d["segment"]}, {**d, "segment": "x"},
            {**d, "segment": other}, {**d, "cuda": {}}, {k: v for k, v in d.items() if k != "segment"},
            {**d, "kind": "cuda"}, [d], None,
        ]
        for descriptor in bad:
            with pytest.raises(samehost.PlaneError):
                client.open(descriptor, export.frames, b"r" * 16, lambda reason: None)
        for payload in ([], [*export.frames, b"x"], [export.frames[0][:-8]], [b"\0" * 8]):
            with pytest.raises(samehost.PlaneError):
                client.open(d, payload, b"r" * 16, lambda reason: None)
        reply = client.open(d, export.frames, b"r" * 16, lambda reason: None)
        assert all(torch.equal(_copy_out(reply)[n], t) for n, t in _tensors(1).items())
        assert reply.settle() is None and plane.ctl.acked(d["slot"])
    finally:
        plane.close()
        client.close()


def test_slot_lifetimes_in_one_process():
    """Acked, cancelled, dead-client and expired slots are lent again; the client notices a reused slot."""
    plane = samehost.WorkerPlane(torch.device("cpu"), slots=1, lease_s=60)
    client = samehost.ClientPlane(torch.device("cpu"))
    resent: list[str] = []
    try:
        first = plane.export(_offer(), _tensors(1), None)
        reply = client.open(first.descriptor, first.frames, b"a" * 16, resent.append)
        assert plane.export(_offer(), _tensors(2), None) is None  # lent, not given back: busy
        assert all(torch.equal(_copy_out(reply)[n], t) for n, t in _tensors(1).items())
        assert reply.settle() is None and not resent
        second = plane.export(_offer(), _tensors(2), None)
        assert second.descriptor["gen"] == first.descriptor["gen"] + 1
        second.dropped()  # undeliverable
        dead = plane.export(_offer(pid=_dead_pid()), _tensors(3), None)
        assert dead is not None and plane.reclaimed == 0
        after_death = plane.export(_offer(), _tensors(4), None)  # the dead client's slot came back
        assert after_death is not None and plane.reclaimed == 1
        after_death.dropped()

        plane.lease_s = 0.05
        slow = plane.export(_offer(), _tensors(5), None)
        slow_reply = client.open(slow.descriptor, slow.frames, b"s" * 16, resent.append)
        time.sleep(0.2)
        fast = plane.export(_offer(), _tensors(6), None)  # lease ran out: lent again, overwritten
        assert fast is not None and plane.reclaimed == 2
        landed = _copy_out(slow_reply)
        assert not torch.equal(landed["probs"], _tensors(5)["probs"])  # what a client would have returned
        slow_reply.settle()
        assert len(resent) == 1  # ... instead it asks again
    finally:
        plane.close()
        client.close()
    assert not _segments(os.getpid())


def test_reap_removes_only_segments_of_dead_owners():
    dead = shm.Owner(shm.pid_namespace(), _dead_pid(), 1234)
    elsewhere = shm.Owner(shm.pid_namespace() + 1, _dead_pid(), 1234)  # another pid namespace: not ours to judge
    ctl = shm.ControlBlock.create(dead.name("0badc0de", "ctl"), 1)
    companions = [f"/torch_{dead.pid}_1_0", f"/cuda.shm.0.{dead.pid:x}.1"]  # CUDA IPC files it left
    for path in companions:
        (shm.SHM_DIR / path[1:]).write_bytes(b"")
        ctl.add_companion(path)
    ctl.close()
    data = shm.Segment.create(dead.name("0badc0de", "s0v1"), 4096)
    foreign = shm.Segment.create(elsewhere.name("0badc0de", "s0v1"), 4096)
    live = samehost.WorkerPlane.start(torch.device("cpu"), 1, 60)  # a worker's start reaps
    try:
        assert live is not None
        names = _segments()
        assert ctl.name not in names and data.name not in names
        assert not any((shm.SHM_DIR / path[1:]).exists() for path in companions)
        assert foreign.name in names and live.ctl.name in names
    finally:
        live.close()
        foreign.unlink()
        for segment in (data, foreign):
            segment.close()


# ------------------------------------------------------------------ real processes


def test_replies_come_through_the_plane(cluster, tiny_target_dir, tiny_vocab_mapping, reference, monkeypatch):
    with RemoteTargetModel(cluster.frontend, timeout=60, num_shards=2, **CLIENT_KW) as client:
        client.set_vocab_mapping(*tiny_vocab_mapping)
        for seed, kind in enumerate(("eagle3", "dspark", "eagle3_compact")):
            batch = reference.batch(seed, batch=4)
            assert_equal_batches(client.generate_batch(*batch, kind=kind), reference.expected(seed, 4, kind=kind,
                                                                                              shards=2))
            assert _mapped()  # the worker's segments are mapped here while replies are read
        assert client.stats.plane_replies == 6 and client.stats.plane_fallbacks == 0
        # Other ops stay frames.
        assert torch.equal(client.get_input_embeddings().weight, reference.engine.get_input_embeddings().weight)
    assert not _mapped()
    for pid in (p.pid for p in cluster.workers[:2]):
        assert not _lent(_control(pid))
    # Off, by the client's argument or by the environment of either side: frames, same tensors (full replies
    # asked for: over frames compact="auto" answers compact, expanded here, which holds the full forward only
    # within one GEMM's rounding; tests/client/test_compact_remote.py checks that).
    monkeypatch.setenv(samehost.ENV, "0")
    for kwargs in ({"same_host_plane": False}, {}):
        with RemoteTargetModel(cluster.frontend, timeout=60, compact=False, **kwargs, **CLIENT_KW) as client:
            client.set_vocab_mapping(*tiny_vocab_mapping)
            assert_equal_batches(client.generate_batch(*reference.batch(0), kind="eagle3"), reference.expected(0))
            assert client.stats.plane_replies == 0 and client.stats.completed >= 2


def test_killed_client_gives_its_slots_back(cluster, tiny_target_dir, reference):
    """A client killed while it holds every slot of a worker (lease 600 s) leaks nothing: its slots are lent
    to the next client at once (the worker sees its process gone)."""
    worker = cluster.workers[3].pid
    ctl = _control(worker)
    proc = subprocess.Popen([sys.executable, str(HERE / "cluster_util.py"), "holding-client", "--broker",
                             cluster.frontend, "--service", "held", "--target", str(tiny_target_dir),
                             "--requests", "2"],
                            env={**os.environ, **FAST_ENV}, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "holding"
        wait_until(lambda: len(_lent(ctl)) == 2, 60, what="both slots lent to the holding client")
    finally:
        kill(proc)
    with RemoteTargetModel(cluster.frontend, service="held", timeout=60, **CLIENT_KW) as client:
        for seed in (3, 4):
            got = client.generate_batch(*reference.batch(seed), kind="dspark")
            assert_equal_batches(got, reference.expected(seed, kind="dspark"))
        assert client.stats.plane_replies == 2 and client.stats.plane_fallbacks == 0
    assert not _lent(ctl)


def test_slow_client_never_returns_reused_bytes(cluster, tiny_vocab_mapping, reference):
    """One slot, lent again 1 s after it was lent: a client still copying after that finds its slot reused
    by another client's reply, drops what it copied and gets its batch again as frames. Digests off: the
    plane's own check must hold without them."""
    copying, other_done = threading.Event(), threading.Event()
    with RemoteTargetModel(cluster.frontend, service="tight", timeout=60, verify="off", **CLIENT_KW) as slow, \
            RemoteTargetModel(cluster.frontend, service="tight", timeout=60, **CLIENT_KW) as other:
        for c in (slow, other):
            c.set_vocab_mapping(*tiny_vocab_mapping)
        opened = _client_plane(slow).open

        def open_slowly(*args, **kwargs):
            reply = opened(*args, **kwargs)
            for span in reply.values():
                copy = span._copy

                def late_copy(out, copy=copy):
                    copying.set()
                    assert other_done.wait(60)
                    copy(out)

                span._copy = late_copy
            return reply

        _client_plane(slow).open = open_slowly
        got: list = []
        caller = threading.Thread(target=lambda: got.append(slow.generate_batch(*reference.batch(1), kind="eagle3")))
        caller.start()  # its copy may block this thread, not the test's
        assert copying.wait(60)
        time.sleep(1.5)  # the slow client's lease (1 s) is over
        assert_equal_batches(other.generate_batch(*reference.batch(2), kind="eagle3"), reference.expected(2))
        assert other.stats.plane_replies == 1  # the reused slot
        other_done.set()
        caller.join(60)
        assert_equal_batches(got[0], reference.expected(1))
        assert slow.stats.plane_replies == 1 and slow.stats.plane_fallbacks == 1


def test_32_clients(cluster, tiny_vocab_mapping, reference):
    workers = cluster.workers[:2]
    rss_before = [rss_kib(p.pid) for p in workers]
    clients = [RemoteTargetModel(cluster.frontend, timeout=120, **CLIENT_KW) for _ in range(32)]
    errors: list[BaseException] = []

    def rank(r: int, client) -> None:
        try:
            kind = ("eagle3", "dspark")[r % 2]
            for seed in (100 + r, 200 + r):
                assert_equal_batches(client.generate_batch(*reference.batch(seed), kind=kind),
                                     reference.expected(seed, kind=kind))
        except BaseException as e:  # reported below
            errors.append(e)

    try:
        for c in clients:
            c.set_vocab_mapping(*tiny_vocab_mapping)
        threads = [threading.Thread(target=rank, args=(r, c)) for r, c in enumerate(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors[:3]
        lent = sum(c.stats.plane_replies for c in clients)
        assert lent >= 32, f"only {lent} of 64 replies came through the plane"
    finally:
        for c in clients:
            c.close()
    assert not _mapped()
    for p, before in zip(workers, rss_before):
        assert not _lent(_control(p.pid))
        assert rss_kib(p.pid) - before < 128 << 10, "worker memory grew by more than 128 MiB"


def test_worker_killed_mid_copy(cluster, tiny_target_dir, reference):
    """A worker SIGKILLed after lending a reply: the client's copy is intact (its mapping outlives the worker),
    and the dead worker's segments are reaped by the client (the next worker start would too)."""
    proc = cluster.start_worker(tiny_target_dir, service="victim")
    cluster.wait_workers(1, service="victim")
    with RemoteTargetModel(cluster.frontend, service="victim", timeout=60, **CLIENT_KW) as client:
        opened = _client_plane(client).open

        def open_then_kill(*args, **kwargs):
            reply = opened(*args, **kwargs)
            assert _segments(proc.pid)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return reply

        _client_plane(client).open = open_then_kill
        assert_equal_batches(client.generate_batch(*reference.batch(5), kind="dspark"),
                             reference.expected(5, kind="dspark"))
        assert client.stats.plane_replies == 1
        wait_until(lambda: not _segments(proc.pid), 30, what="the killed worker's segments reaped")
    assert not _mapped()


def test_wire_layout_matches_encode():
    """The plane's payload frame is exactly the header frame ``encode`` sends."""
    tensors = _tensors(7)
    header, placed = wire.layout(tensors)
    assert header == bytes(wire.encode(tensors)[0])
    layout, _ = wire.parse_header(header, placed[-1][3])
    described = {n: (dtype, shape) for n, (dtype, shape, _, _) in layout.items()}
    assert described == {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}


# ------------------------------------------------------------------ GPU (run on an H200)


def _ipc_files(pid: int) -> list[str]:
    """Files CUDA IPC shares of process ``pid`` left in /dev/shm: torch's ref counters, the driver's event file."""
    return [n for n in os.listdir(shm.SHM_DIR) if shm.companion_pid("/" + n) == pid]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_cuda_ipc_plane(tiny_target_dir, tiny_vocab_mapping, tmp_path):
    """Worker on cuda:0; clients on cuda:0 and (with two GPUs) cuda:1 copy its replies device to device
    through CUDA IPC, a CPU client through its page-locked shared memory; every batch equals the colocated
    forward on the worker's GPU. A SIGKILLed GPU worker's segments and CUDA IPC files are reaped by the next
    worker start; a worker stopped normally leaves none."""
    from spec_serve.engines.hf import HFTarget

    colocated = HFTarget(tiny_target_dir, device="cuda:0", dtype="bfloat16")
    colocated.set_vocab_mapping(*tiny_vocab_mapping)
    inputs = [sample_batch(tiny_target_dir, 4, 64, seed=s) for s in range(3)]
    worker_args = ("--device", "cuda:0", "--dtype", "bfloat16")
    devices = ["cuda:0", "cuda:1"][: torch.cuda.device_count()] + ["cpu"]

    def check(device: str, batches) -> None:
        with RemoteTargetModel(c.frontend, device=device, prefetch_depth=2, num_shards=2, timeout=120,
                               **CLIENT_KW) as client:
            client.set_vocab_mapping(*tiny_vocab_mapping)
            futures = [(x, kind, client.generate_batch_async(*x, kind=kind))
                       for x in batches for kind in ("eagle3", "dspark")]
            for x, kind, future in futures:
                got = future.result(timeout=120)
                assert all(t.device == torch.device(device) for t in got.values())
                # GPU kernels are chosen by shape: the reference runs each shard's rows alone, as the worker did.
                halves = [colocated.generate_batch(*(t[lo:lo + 2] for t in x), kind=kind) for lo in (0, 2)]
                assert_equal_batches(got, {k: torch.cat([h[k] for h in halves]) for k in halves[0]})
            assert client.stats.plane_replies == 2 * len(futures) and client.stats.plane_fallbacks == 0

    with local_cluster(tiny_target_dir, workers=1, worker_args=worker_args, env=FAST_ENV, log_dir=tmp_path) as c:
        worker = c.workers[0]
        for device in devices:
            check(device, inputs)
            data = {n for n in _segments(worker.pid) if not n.endswith(".ctl")}
            # GPU clients read device memory (no shared-memory data segment); the CPU client a segment.
            assert bool(data) == (device == "cpu"), (device, data)
            assert not _lent(_control(worker.pid))
        left = _ipc_files(worker.pid)
        assert any(n.startswith("torch_") for n in left) and any(n.startswith("cuda.shm.") for n in left), left
        kill(worker)
        second = c.start_worker(tiny_target_dir, *worker_args)
        wait_until(lambda: not _segments(worker.pid) and not _ipc_files(worker.pid), 120,
                   what="the killed GPU worker's segments and CUDA IPC files reaped by the next worker")
        check("cuda:0", inputs[:1])  # the second worker shares its own slots
        assert _ipc_files(second.pid)
    assert second.returncode == 0
    assert not _segments(second.pid) and not _ipc_files(second.pid)  # a normal stop leaves nothing
    assert "terminated before all shared CUDA tensors released" not in (tmp_path / "worker1.log").read_text()
