"""Stopping workers and the broker as orchestrators do (issue 23 item 1), with real processes on CPU.

SIGTERM (Kubernetes, Slurm, systemd) or SIGINT (Ctrl-C) drains a worker: LEAVE at once, the requests it
never started go back to the broker and on to another worker, the forward it runs and the replies it
owes finish (sent, or lent through the same-host plane until the client gives the slot back), then it
leaves for good and exits 0 with none of its /dev/shm segments left. A second signal, or the end of
``--drain-timeout``, stops it at once, still with status 0: the broker gives what it held to another
worker. A broker told to stop tells its clients and workers, and a successor on the same ports serves
them. Each stage of a request is caught by a forward held at a gate the test opens (``cluster_util.Gate``,
SPEC_SERVE_TEST_HOLD_FORWARD), in ``cluster_util.py slow-worker`` (which installs the same signal handling
as ``spec-serve worker``) or in the CLI worker itself: what runs while a forward runs is ordered by events
the processes report, never by how long a forward takes.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from pathlib import Path

import pytest
import torch
import zmq

import spec_serve.client.sockets as client_module
from cluster_util import (
    CLIENT_KW,
    FAST_ENV,
    Gate,
    Reference,
    assert_contract,
    assert_equal_batches,
    captured_log,
    hold_plane_copies,
    kill,
    stall_replies,
    start_slow_worker,
    wait_until,
)
from spec_serve.client.api import RemoteTargetModel
from spec_serve.paths.plane import shm
from spec_serve.tools.launch import local_cluster


@pytest.fixture(scope="module")
def cluster(tiny_target_dir, tmp_path_factory):
    """A broker and worker B (capacity 1), which takes what a stopping worker hands back."""
    with local_cluster(tiny_target_dir, workers=1, env=FAST_ENV, worker_args=("--capacity", "1"),
                       log_dir=tmp_path_factory.mktemp("lifecycle-logs")) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_target_dir, tiny_vocab_mapping):
    return Reference(tiny_target_dir, tiny_vocab_mapping)


def _slow_worker(cluster, target, delay: float, *extra: str, gate: Gate | None = None) -> tuple[subprocess.Popen, Path]:
    """A slow-worker process and its log file; with ``gate``, each forward it begins waits for the gate."""
    log = cluster.log_dir / f"slow-worker{len(cluster.workers)}.log"
    return start_slow_worker(cluster, target, delay, *extra, env=gate.env if gate else None), log


def _line(log: Path, pattern: str, timeout: float = 60.0) -> str:
    """The first line of ``log`` matching ``pattern``, waiting for it."""
    def find():
        text = log.read_text() if log.exists() else ""
        return next((line for line in text.splitlines() if re.search(pattern, line)), None)
    return wait_until(find, timeout, what=f"{pattern!r} in {log.name}")


def _worker(cluster, name: str) -> dict:
    """The broker's entry for worker ``name`` (GET /workers; empty until its snapshot lists it)."""
    return next((w for w in cluster.get("/workers")[1]["workers"] if w["id"] == name), {})


def _worker_name(log: Path) -> str:
    return re.search(r"worker=(\w+)", _line(log, r"worker\.ready")).group(1)


def _own_segments(pid: int) -> set[str]:
    """Same-host plane segments in /dev/shm created by process ``pid`` (other tests' are not ours to judge)."""
    return {n for n in os.listdir(shm.SHM_DIR) if (o := shm.owner_of(n)) is not None and o.pid == pid}


def _metric(cluster, name: str) -> float:
    _, text = cluster.get("/metrics")
    found = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def _left_cleanly(cluster, log: Path, name: str, reason: str) -> None:
    """The broker logged the worker as gone because it left (``reason``), never as expired."""
    broker_log = (cluster.log_dir / "broker.log").read_text()
    gone = [line for line in broker_log.splitlines() if "broker.worker_gone" in line and f"worker={name}" in line]
    assert len(gone) == 1 and f"reason='left: {reason}" in gone[0], gone
    assert "heartbeat expired" not in gone[0]


# ------------------------------------------------------------------------------------- workers


def test_sigterm_drains_a_worker_mid_forward_and_hands_back_its_queue(cluster, tiny_target_dir, reference, tmp_path):
    """Worker A (capacity 3) holds one request in a forward and two queued when SIGTERM comes: the queued two
    go back at once and B serves them while A's forward still runs (no gap), then A delivers its own reply,
    leaves, and exits 0. Both forwards wait for gates the test opens: B's first one until A holds its three
    (so the broker gives B one and A three), A's until B has served the rest, so "while A's forward still
    runs" is a fact, not a bet on how long a forward takes."""
    a_gate, b_gate = Gate(tmp_path / "a-gate"), Gate(tmp_path / "b-gate")
    other, other_log = _slow_worker(cluster, tiny_target_dir, 0.0, "--service", "drain", "--capacity", "1",
                                    gate=b_gate)
    proc, log = _slow_worker(cluster, tiny_target_dir, 0.0, "--service", "drain", "--capacity", "3",
                             "--drain-timeout", "300", gate=a_gate)
    name, b_name = _worker_name(log), _worker_name(other_log)
    redispatched = _metric(cluster, "spec_serve_redispatched_total")
    with RemoteTargetModel(cluster.frontend, service="drain", timeout=120, prefetch_depth=4, **CLIENT_KW) as client:
        futures = {seed: client.generate_batch_async(*reference.batch(seed), kind="dspark") for seed in range(4)}
        # Neither can finish one: B (capacity 1) holds one in its forward, A one in its forward and two queued.
        _line(log, r"worker\.test_hold")
        _line(other_log, r"worker\.test_hold")
        wait_until(lambda: _worker(cluster, name).get("inflight") == 3, 60, what="three requests on A")
        proc.send_signal(signal.SIGTERM)
        draining = _line(log, r"worker\.draining")
        b_gate.open()
        # B serves its own and the two A handed back while A's forward waits for its gate: nobody waits for A.
        wait_until(lambda: sum(f.done() for f in futures.values()) == 3, 120, what="three answered")
        wait_until(lambda: _worker(cluster, b_name).get("completed") == 3, 60, what="B's three DONEs")
        assert proc.poll() is None and "worker.stop " not in log.read_text()  # A is still in its forward
        a_gate.open()
        for seed, future in futures.items():
            assert_equal_batches(future.result(timeout=120), reference.expected(seed, kind="dspark"))
    assert proc.wait(60) == 0
    stop = _line(log, r"worker\.stop ")
    assert "served=1 " in stop and "handed_back=2 " in stop and "outcome=drained" in stop, stop
    assert "reason=SIGTERM" in draining and "running=1" in draining, draining
    assert _metric(cluster, "spec_serve_redispatched_total") - redispatched == 2
    _left_cleanly(cluster, log, name, "stopped: drained")
    assert not _own_segments(proc.pid)
    other.send_signal(signal.SIGTERM)
    assert other.wait(60) == 0


def test_a_second_signal_stops_a_worker_mid_forward_and_another_serves_its_request(cluster, tiny_target_dir,
                                                                                   reference, tmp_path):
    """A forward that cannot finish (its gate never opens): a second SIGTERM stops the worker at once; it leaves
    the pool (the broker gives the request to B), releases its segments and exits 0."""
    proc, log = _slow_worker(cluster, tiny_target_dir, 0.0, "--capacity", "1", gate=Gate(tmp_path / "closed"))
    name = _worker_name(log)
    with RemoteTargetModel(cluster.frontend, timeout=60, prefetch_depth=2, **CLIENT_KW) as client:
        futures = [client.generate_batch_async(*reference.batch(seed), kind="dspark") for seed in (10, 11)]
        _line(log, r"worker\.test_hold")  # one of them; B answers the other
        proc.send_signal(signal.SIGTERM)
        _line(log, r"worker\.draining")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0  # its forward never ends: it did not wait for it
        for seed, future in zip((10, 11), futures):
            assert_equal_batches(future.result(timeout=60), reference.expected(seed, kind="dspark"))
        assert client.stats.duplicates == 0  # nothing answered was sent again
    stop = _line(log, r"worker\.stop ")
    assert "abandoned_forward=1" in stop and "served=0 " in stop and "outcome='stopped at once'" in stop, stop
    _line(log, r"worker\.exit_mid_forward")
    _left_cleanly(cluster, log, name, "stopped at once")
    assert not _own_segments(proc.pid)


@pytest.fixture
def stalled_client(monkeypatch):
    """Clients made now queue one reply in libzmq and 64 KiB in the kernel, so a reader that stalls keeps
    the rest of a large reply in the worker's libzmq; returns a function that stalls a client's reader."""
    make_socket = client_module.make_socket

    def small_buffers(ctx, kind, **kwargs):
        if kind == zmq.PULL:
            kwargs["hwm"] = 1
        sock = make_socket(ctx, kind, **kwargs)
        if kind == zmq.PULL:
            sock.setsockopt(zmq.RCVBUF, 64 << 10)  # before the data socket binds
        return sock

    monkeypatch.setattr(client_module, "make_socket", small_buffers)

    def stall(client: RemoteTargetModel) -> threading.Event:
        stalled = stall_replies(client)
        stalled.set()
        return stalled

    return stall


def test_a_drain_waits_for_a_reply_being_sent_and_a_slot_being_copied(cluster, tiny_target_dir, reference,
                                                                      stalled_client, monkeypatch):
    """SIGTERM while the worker's answers are on their way: two 12 MiB replies handed to ZeroMQ (DONE sent)
    that a stalled client does not read, and one lent through the same-host plane that another client is
    still copying. The worker keeps its sockets and its segment until every byte left and the slot came
    back, then exits 0 and unlinks the segment."""
    proc, log = _slow_worker(cluster, tiny_target_dir, 0.0, "--service", "lent", "--capacity", "3")
    _worker_name(log)
    copying, go_on = hold_plane_copies(monkeypatch)
    big = {"batch": 32, "seq": 128}
    kw = {"service": "lent", "timeout": 60, "heartbeat_interval": CLIENT_KW["heartbeat_interval"], "liveness": 100}
    with RemoteTargetModel(cluster.frontend, same_host_plane=False, prefetch_depth=2, **kw) as framed, \
            RemoteTargetModel(cluster.frontend, **kw) as lent:
        stalled = stalled_client(framed)
        sent = {seed: framed.generate_batch_async(*reference.batch(seed, **big), kind="dspark") for seed in (30, 31)}
        copied = lent.generate_batch_async(*reference.batch(32), kind="dspark")
        assert copying.wait(60)

        def completed():
            (worker,) = [w for w in cluster.get("/workers")[1]["workers"] if w["service"] == "lent"]
            return worker["completed"] == 3  # DONE for all three: the replies are ZeroMQ's, the slot lent
        wait_until(completed, 60, what="every reply handed over")
        proc.send_signal(signal.SIGTERM)
        draining = _line(log, r"worker\.draining")
        assert int(re.search(r"unsent=(\d+)", draining).group(1)) >= 1 and "lent=1" in draining, draining
        assert proc.poll() is None and _own_segments(proc.pid)  # waiting, its segment still there
        stalled.clear()
        for seed, future in sent.items():
            assert_equal_batches(future.result(timeout=60), reference.expected(seed, **big, kind="dspark"))
        assert proc.poll() is None  # the slot is still out
        go_on.set()
        assert_equal_batches(copied.result(timeout=60), reference.expected(32, kind="dspark"))
        assert lent.stats.plane_replies == 1 and lent.stats.plane_fallbacks == 0
        assert framed.stats.plane_replies == 0
    assert proc.wait(30) == 0
    assert "outcome=drained" in _line(log, r"worker\.stop ")
    assert not _own_segments(proc.pid)


@pytest.mark.parametrize("how", ["sigint", "sigterm-timeout"])
def test_the_cli_worker_stopped_in_a_real_forward_exits_0(cluster, tiny_target_dir, colocated_target, how, tmp_path):
    """`spec-serve worker` X stopped inside a forward (of a 4 x 1024 shard; B computes the other), held at its
    start until the test opens its gate: Ctrl-C drains it (the gate opens once it drains; it delivers its
    shard), SIGTERM with --drain-timeout 0.5 stops it mid-forward (the gate stays shut until X said it stops,
    then the forward runs on as the process ends; B computes X's shard too). Either way it exits 0 (it used
    to abort: "terminate called without an active exception", status 134) and the batch is whole."""
    from spec_serve.tools.tiny import sample_batch

    gate = Gate(tmp_path / "gate")
    extra = ("--drain-timeout", "0.5") if how == "sigterm-timeout" else ("--drain-timeout", "300")
    proc = cluster.start_worker(tiny_target_dir, "--capacity", "1", *extra, env=gate.env)
    log = cluster.log_path(f"worker{len(cluster.workers) - 1}")
    _worker_name(log)
    batch = sample_batch(tiny_target_dir, 8, 1024, seed=40)
    with RemoteTargetModel(cluster.frontend, num_shards=2, timeout=120, **CLIENT_KW) as client:
        future = client.generate_batch_async(*batch, kind="dspark")
        _line(log, r"worker\.test_hold")  # X is in its forward, until the gate opens
        proc.send_signal(signal.SIGINT if how == "sigint" else signal.SIGTERM)
        _line(log, r"worker\.draining" if how == "sigint" else r"worker\.stop ")
        gate.open()
        assert proc.wait(120) == 0, log.read_text()[-2000:]
        assert_contract(future.result(timeout=120), colocated_target(), batch, "dspark", shards=2)
    stop = _line(log, r"worker\.stop ")
    if how == "sigint":
        assert "served=1 " in stop and "outcome=drained" in stop, stop
    else:
        assert "abandoned_forward=1" in stop and "outcome='drain timed out after 0.5s'" in stop, stop
        _line(log, r"worker\.exit_mid_forward")
    assert not _own_segments(proc.pid)


def _cuda_ipc_files(pid: int) -> list[str]:
    """Files the CUDA IPC shares of process ``pid`` left in /dev/shm (torch's ref counters, the driver's)."""
    return [n for n in os.listdir(shm.SHM_DIR) if shm.companion_pid("/" + n) == pid]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("signals", [1, 2], ids=["drain", "second-signal"])
def test_gpu_worker_stopped_releases_its_cuda_ipc_slots(cluster, tiny_target_dir, signals, tmp_path):
    """A worker on cuda:0 lends a GPU client its replies through CUDA IPC; stopped in a forward held at its gate,
    it exits 0 and leaves none of its segments or CUDA IPC files: drained (the gate opens once it drains; its
    reply delivered, equal to the colocated forward on that GPU), or stopped at once by a second signal (the
    gate never opens: the process ends itself mid-forward, so torch's own cleanup does not run: the worker
    removes them)."""
    from spec_serve.engines.hf import HFTarget
    from spec_serve.tools.tiny import sample_batch

    service, gate = f"gpu-{signals}", Gate(tmp_path / "gate")
    proc, log = _slow_worker(cluster, tiny_target_dir, 0.0, "--device", "cuda:0", "--service", service, gate=gate)
    _worker_name(log)
    colocated = HFTarget(tiny_target_dir, device="cuda:0")
    batches = [sample_batch(tiny_target_dir, 2, 16, seed=s) for s in (70, 71)]
    with RemoteTargetModel(cluster.frontend, service=service, device="cuda:0", timeout=60, **CLIENT_KW) as client:
        gate.open()  # the first forward goes through
        first = client.generate_batch(*batches[0], kind="dspark")  # lent through CUDA IPC: the files exist
        assert_equal_batches(first, colocated.generate_batch(*batches[0], kind="dspark"))
        assert client.stats.plane_replies == 1 and _cuda_ipc_files(proc.pid)
        gate.path.unlink()  # the second one waits
        future = client.generate_batch_async(*batches[1], kind="dspark")
        wait_until(lambda: log.read_text().count("worker.test_hold") == 2, 60, what="the second forward")
        for _ in range(signals):
            proc.send_signal(signal.SIGTERM)
            _line(log, r"worker\.draining")
        if signals == 1:
            gate.open()
        assert proc.wait(60) == 0, log.read_text()[-3000:]
        if signals == 1:
            assert_equal_batches(future.result(timeout=60), colocated.generate_batch(*batches[1], kind="dspark"))
    assert not _own_segments(proc.pid) and not _cuda_ipc_files(proc.pid)
    if signals == 2:
        _line(log, r"worker\.exit_mid_forward")


# -------------------------------------------------------------------------------------- broker



def test_broker_sigterm_tells_clients_and_workers_and_exits_0(cluster, tiny_target_dir, reference, tmp_path):
    """SIGTERM on the broker while one request is in a forward (held at its gate until the worker found the new
    broker) and one queued: it tells the client (``client.broker_stopping``, not ``client.broker_lost`` after
    the liveness window) and the worker (which registers again), exits 0; a broker started on the same ports
    gets both re-sent and serves them. (The module's last test: its cluster goes on with the new broker.)"""
    gate = Gate(tmp_path / "gate")
    proc, log = _slow_worker(cluster, tiny_target_dir, 0.0, "--capacity", "1", "--service", "broker-stop", gate=gate)
    _worker_name(log)
    with captured_log("spec_serve.client") as lines, \
            RemoteTargetModel(cluster.frontend, service="broker-stop", timeout=60, prefetch_depth=2,
                              **CLIENT_KW) as client:
        futures = [client.generate_batch_async(*reference.batch(seed), kind="dspark") for seed in (50, 51)]
        _line(log, r"worker\.test_hold")
        cluster.broker.send_signal(signal.SIGTERM)
        assert cluster.broker.wait(30) == 0
        stopping = _line(cluster.log_path("broker"), r"broker\.stopping")
        assert "queued=1 inflight=1" in stopping and " workers=2 " in stopping, stopping
        wait_until(lambda: any("client.broker_stopping" in line for line in lines), 30, what="client.broker_stopping")
        _line(log, r"worker\.broker_stopping")
        cluster.start_broker()
        _line(log, r"worker\.broker_regained")
        gate.open()
        for seed, future in zip((50, 51), futures):
            assert_equal_batches(future.result(timeout=60), reference.expected(seed, kind="dspark"))
        assert not any("client.broker_lost" in line for line in lines), lines
    kill(proc)
