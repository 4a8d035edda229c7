"""NCCL data plane (issue 5) with real broker and worker processes: gloo on CPU here, NCCL on 2 GPUs.

A client with ``enable_nccl=True`` binds a worker of its own; replies carry only tensor specs over
ZeroMQ and the bytes over a private 2-rank group. Every result is compared with ``torch.equal``
against the colocated ``HFTarget``. See docs/nccl.md for the message sequence.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from cluster_util import (
    FORGIVING_CLIENT_KW,
    FORGIVING_ENV,
    assert_contract,
    assert_equal_batches,
    listening_addresses,
    network_address,
    wait_until,
    workers,
)
from spec_serve.client.api import RemoteTargetModel
from spec_serve.protocol.commands import ClientCommand
from spec_serve.protocol.messages import BindRequest
from spec_serve.tools.launch import local_cluster
from spec_serve.tools.tiny import sample_batch

ENV = FORGIVING_ENV
CLIENT_KW = FORGIVING_CLIENT_KW
NCCL_KW = {**CLIENT_KW, "enable_nccl": True, "nccl_timeout": 20}


@pytest.fixture(scope="module")
def cluster(tiny_target_dir, tmp_path_factory):
    """Two workers of "default", and one of "faulty" whose first pair-group send aborts (test-only hook)."""
    log_dir = tmp_path_factory.mktemp("nccl-logs")
    with local_cluster(tiny_target_dir, workers=2, env=ENV, log_dir=log_dir) as c:
        c.env = {**ENV, "SPEC_SERVE_TEST_FAIL_NCCL_SEND": "1"}
        c.start_worker(tiny_target_dir, service="faulty")
        c.env = dict(ENV)
        c.wait_workers(1, service="faulty")
        yield c


@pytest.fixture(scope="module")
def reference(colocated_target):
    return colocated_target()




def check(client, reference, target_dir, seed: int, kind: str, batch: int = 3, seq: int = 24,
          mapping=None) -> None:
    """The contract for one batch; a batch that came compact (frames: compact="auto" answers compact) against the
    colocated compact batch expanded with the draft-vocab ``mapping`` (bit for bit), not the full forward (within
    one GEMM's rounding only)."""
    inputs = sample_batch(target_dir, batch, seq, seed=seed)
    before = client.stats.compact_replies
    got = client.generate_batch(*inputs, kind=kind)
    compact = client.stats.compact_replies > before
    assert mapping is not None or not compact, "a batch came compact: pass the mapping to check it"
    assert_contract(got, reference, inputs, kind, client.num_shards, compact=compact, selected=mapping)


def bound_workers(cluster, service="default") -> dict[str, str]:
    return {w["id"]: w["bound_to"] for w in workers(cluster, service) if w["state"] == "bound"}


def completed(cluster) -> dict[str, int]:
    return {w["id"]: w["completed"] for w in workers(cluster, "default")}


def worker_logs(cluster, names=("worker0", "worker1")) -> str:
    return "".join((cluster.log_dir / f"{n}.log").read_text() for n in names)


def wait_unbound(cluster, service="default", timeout=30.0) -> None:
    wait_until(lambda: not bound_workers(cluster, service), timeout=timeout, what=f"no bound worker of {service}")


def test_bound_path_equals_colocated_and_pool_serves_others(cluster, tiny_target_dir, tiny_vocab_mapping, reference):
    with RemoteTargetModel(cluster.frontend, prefetch_depth=2, num_shards=2, **NCCL_KW) as bound:
        bound.set_vocab_mapping(*tiny_vocab_mapping)
        for seed, kind in [(1, "eagle3"), (2, "dspark")]:
            check(bound, reference, tiny_target_dir, seed, kind)
        worker = bound.bound_worker
        assert worker is not None
        # Prefetched, two shards each: every shard goes to the bound worker, over the group.
        inputs = [sample_batch(tiny_target_dir, 4, 16, seed=s) for s in (3, 4)]
        futures = [bound.generate_batch_async(*x, kind=k) for x, k in zip(inputs, ("eagle3", "dspark"))]
        for x, k, f in zip(inputs, ("eagle3", "dspark"), futures):
            assert_contract(f.result(timeout=120), reference, x, k, shards=2)
        stats = bound.stats
        # 2 single calls x 2 shards + 2 prefetched x 2 shards: all delivered by the group, none as frames.
        assert stats.nccl_batches == 8 and stats.nccl_fallbacks == 0, stats
        assert list(bound_workers(cluster)) == [worker]

        # A plain client is served by the other worker meanwhile.
        other = next(w["id"] for w in workers(cluster, "default") if w["id"] != worker)
        # The broker's snapshot settles (our DONEs counted) before the baseline is taken.
        wait_until(lambda: all(w["inflight"] == 0 for w in workers(cluster, "default")), timeout=10, what="idle")
        time.sleep(0.5)
        before = completed(cluster)
        with RemoteTargetModel(cluster.frontend, **CLIENT_KW) as plain:
            plain.set_vocab_mapping(*tiny_vocab_mapping)
            check(plain, reference, tiny_target_dir, 5, "eagle3")
            assert plain.bound_worker is None and plain.stats.nccl_batches == 0
        wait_until(lambda: completed(cluster)[other] > before[other], timeout=10, what="the other worker served it")
        time.sleep(0.5)
        assert completed(cluster) == {worker: before[worker], other: before[other] + 1}, (before, completed(cluster))
    print(f"\nbound to {worker}: {stats}")
    # close() released it: back in the pool.
    wait_unbound(cluster)
    # The worker's log shows the binding and its release, with the number of replies sent over the group.
    wait_until(lambda: "reason=released sent=8" in worker_logs(cluster), timeout=10, what="worker released its pair")
    assert "worker.nccl_bound" in worker_logs(cluster)


def test_fp8_asked_over_the_pair_group_comes_in_the_model_dtype_and_is_counted(cluster, tiny_target_dir,
                                                                                 tiny_vocab_mapping, reference):
    """The pair group sends the model dtype (paths/nccl: ``sends_fp8`` False): a wire_dtype="fp8" client bound to
    a worker gets bit-equal model-dtype replies, counts each in stats.fp8_declined, and the worker says why."""
    with RemoteTargetModel(cluster.frontend, num_shards=2, wire_dtype="fp8", **NCCL_KW) as bound:
        bound.set_vocab_mapping(*tiny_vocab_mapping)
        for seed, kind in [(6, "eagle3"), (7, "dspark")]:
            check(bound, reference, tiny_target_dir, seed, kind)
        stats = bound.stats
    assert stats.nccl_batches == 4 and (stats.fp8_replies, stats.fp8_declined) == (0, 4), stats
    wait_unbound(cluster)
    assert 'worker.fp8_declined' in worker_logs(cluster) and "the nccl reply path sends the model dtype" in \
        worker_logs(cluster)


def test_bind_refused_when_all_bound_falls_back_to_frames(cluster, tiny_target_dir, tiny_vocab_mapping, reference,
                                                          caplog):
    """Every worker bound: a third client's BIND is refused at once and it sends frames; its request is served
    by the worker of the newest binding, which the broker ends for it."""
    a = RemoteTargetModel(cluster.frontend, **NCCL_KW)
    try:
        with RemoteTargetModel(cluster.frontend, **NCCL_KW) as b, \
                RemoteTargetModel(cluster.frontend, **NCCL_KW) as c:
            check(a, reference, tiny_target_dir, 6, "dspark")
            check(b, reference, tiny_target_dir, 7, "dspark")
            assert {a.bound_worker, b.bound_worker} == {w["id"] for w in workers(cluster, "default")}
            inputs = sample_batch(tiny_target_dir, 3, 24, seed=8)
            with caplog.at_level(logging.WARNING, logger="spec_serve.client"):
                start = time.monotonic()
                future = c.generate_batch_async(*inputs, kind="dspark")  # binding refused: sent as frames
                refused_in = time.monotonic() - start
            lines = [r.getMessage() for r in caplog.records if "client.nccl_fallback" in r.getMessage()]
            assert len(lines) == 1 and "are bound to other clients" in lines[0], lines
            assert refused_in < 10, "a refusal must come at once, not after a timeout"
            assert c.bound_worker is None
            # No unbound worker is left while c's request waits: the broker ends the newest binding (b's) and
            # that worker serves c (the old broker left c waiting until a client let go).
            assert_equal_batches(future.result(timeout=60), reference.generate_batch(*inputs, kind="dspark"))
            wait_until(lambda: b.bound_worker is None, timeout=10, what="b's binding ended")
            assert a.bound_worker is not None
            assert c.stats.nccl_batches == 0 and c.bound_worker is None
            assert b.stats.nccl_batches == 1
            print(f"\nrefused in {refused_in:.3f}s: {lines[0]}")
    finally:
        a.close()
    wait_unbound(cluster)


def test_a_bind_the_worker_refuses_gives_the_worker_back(cluster, tiny_target_dir, reference):
    """A BIND the worker refuses (here: a CUDA client for a CPU worker) leaves no binding at the broker: the
    worker is back in the pool at once (the old broker kept it bound to the client, out of the pool)."""
    wait_unbound(cluster)
    with RemoteTargetModel(cluster.frontend, **CLIENT_KW) as client:
        client.target_info()
        header = BindRequest(reply_to=client._io.data_endpoint, timeout=10, device_type="cuda")
        future = client._io.submit(ClientCommand.BIND, "default", header, (), 10, max_retries=0)
        with pytest.raises(Exception, match="client device is cuda") as refused:
            future.result(30)
        wait_unbound(cluster, timeout=10)
        check(client, reference, tiny_target_dir, 14, "dspark")
    print(f"\nrefused by the worker: {refused.value}")


KILLED_CLIENT = textwrap.dedent("""
    import sys, time
    from spec_serve.client.api import RemoteTargetModel
    from spec_serve.tools.tiny import sample_batch
    frontend, target = sys.argv[1], sys.argv[2]
    client = RemoteTargetModel(frontend, enable_nccl=True, timeout=60, heartbeat_interval=0.2, liveness=15)
    client.generate_batch(*sample_batch(target, 2, 16, seed=0), kind="dspark")
    print("BOUND", client.bound_worker, client.stats.nccl_batches, flush=True)
    time.sleep(600)
""")


def test_killed_client_frees_its_worker(cluster, tiny_target_dir, tiny_vocab_mapping, reference):
    wait_unbound(cluster)
    proc = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, cluster.frontend, str(tiny_target_dir)],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, **ENV})
    try:
        line = proc.stdout.readline().split()
        assert line[:1] == ["BOUND"] and line[2] == "1", line
        worker = line[1]
        assert list(bound_workers(cluster)) == [worker]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    killed_at = time.monotonic()
    wait_unbound(cluster, timeout=30)  # the broker's client expiry (3 s here) released it
    freed_s = time.monotonic() - killed_at
    # It serves others again: a new client binds it (the other is taken) and gets correct results.
    with RemoteTargetModel(cluster.frontend, **NCCL_KW) as hold, RemoteTargetModel(cluster.frontend, **NCCL_KW) as c:
        check(hold, reference, tiny_target_dir, 9, "dspark")
        check(c, reference, tiny_target_dir, 10, "dspark")
        assert worker in (hold.bound_worker, c.bound_worker)
        assert hold.stats.nccl_batches == c.stats.nccl_batches == 1
    print(f"\nkilled client's worker {worker} freed in {freed_s:.1f}s")
    wait_unbound(cluster)


def test_failed_send_recovers_over_frames_then_rebinds(cluster, tiny_target_dir, tiny_vocab_mapping, reference):
    """The "faulty" worker aborts its first pair-group send (SPEC_SERVE_TEST_FAIL_NCCL_SEND=1)."""
    with RemoteTargetModel(cluster.frontend, service="faulty", **NCCL_KW) as client:
        client.set_vocab_mapping(*tiny_vocab_mapping)
        start = time.monotonic()
        # Delivered as frames after the failure: asked again without the pair group, so answered compact.
        check(client, reference, tiny_target_dir, 11, "eagle3", mapping=tiny_vocab_mapping)
        assert client.stats.compact_replies == 1
        recovered_s = time.monotonic() - start
        stats = client.stats
        assert stats.nccl_fallbacks == 1 and stats.nccl_batches == 0, stats
        assert client.bound_worker is None  # broken, released
        check(client, reference, tiny_target_dir, 12, "eagle3")  # this call binds again
        check(client, reference, tiny_target_dir, 13, "dspark")
        assert client.bound_worker is not None
        assert stats.nccl_batches == 2 and stats.nccl_fallbacks == 1, stats
        # Its only worker is bound to it: other requests go to it too (as frames), not to an empty pool.
        assert torch.equal(client.get_output_embeddings().weight, reference.get_output_embeddings().weight)
    print(f"\nfailed send recovered in {recovered_s:.1f}s; then rebound: {stats}")
    wait_unbound(cluster, service="faulty")
    log = worker_logs(cluster, ("worker2",))
    assert "worker.nccl_send_failed" in log and "SPEC_SERVE_TEST_FAIL_NCCL_SEND" in log


# --- GPU: worker on cuda:0, client on cuda:1 (run on the 2-GPU machine) ------------------------


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_gpu_nccl_equals_colocated_and_throughput(tiny_target_dir, tiny_vocab_mapping):
    from spec_serve.engines.hf import HFTarget

    batch, seq, steps = 8, 512, 20
    inputs = [sample_batch(tiny_target_dir, batch, seq, seed=s) for s in range(4)]
    tokens = sum(int(x[1].sum()) for x in inputs) * steps // len(inputs)
    colocated = HFTarget(tiny_target_dir, device="cuda:1", dtype="bfloat16")
    colocated.set_vocab_mapping(*tiny_vocab_mapping)

    def rate(run) -> float:
        torch.cuda.synchronize("cuda:1")
        start = time.perf_counter()
        run()
        torch.cuda.synchronize("cuda:1")
        return tokens / (time.perf_counter() - start)

    def remote_run(client):
        futures = [client.generate_batch_async(*inputs[i % len(inputs)], kind="eagle3") for i in range(steps)]
        for f in futures:
            f.result(timeout=300)

    rates = {}
    with local_cluster(tiny_target_dir, workers=1, worker_args=("--device", "cuda:0", "--dtype", "bfloat16"),
                       env=ENV) as c:
        # frames_2_shards: both shards' bytes are copied host->cuda:1 straight into rows of one tensor.
        for mode, extra in (("nccl", {"enable_nccl": True}), ("frames", {}), ("frames_2_shards", {"num_shards": 2})):
            with RemoteTargetModel(c.frontend, device="cuda:1", prefetch_depth=2, timeout=120,
                                   heartbeat_interval=0.2, liveness=15, **extra) as client:
                client.set_vocab_mapping(*tiny_vocab_mapping)
                for x in inputs[:2]:
                    for kind in ("eagle3", "dspark"):
                        got = client.generate_batch(*x, kind=kind)
                        assert all(t.device == torch.device("cuda:1") for t in got.values())
                        assert_contract(got, colocated, x, kind, client.num_shards)
                rates[mode] = rate(lambda: remote_run(client))
                if mode == "nccl":
                    assert client.bound_worker is not None
                    assert client.stats.nccl_batches == 4 + steps and client.stats.nccl_fallbacks == 0
                else:
                    assert client.stats.nccl_batches == 0
            wait_unbound(c, timeout=30)
    rates["colocated"] = rate(lambda: [colocated.generate_batch(*inputs[i % len(inputs)], kind="eagle3")
                                       for i in range(steps)])
    print(f"\ndelivered tokens/s, tiny target bf16, batch {batch}x{seq}, {steps} batches: "
          + ", ".join(f"{k} {v:,.0f}" for k, v in rates.items()))


def test_rendezvous_listens_only_on_the_advertised_address(cluster, tiny_target_dir, reference):
    """The bound worker's TCPStore and gloo connections, and the client's, listen on the address peers
    are told (loopback here), never on every interface (a TCPStore binds all unless handed a socket)."""
    loopback = "0100007F"
    before = listening_addresses(os.getpid())
    with RemoteTargetModel(cluster.frontend, **NCCL_KW) as client:
        check(client, reference, tiny_target_dir, 11, "dspark")
        assert client.bound_worker is not None
        at_worker = set().union(*(listening_addresses(p.pid) for p in cluster.workers if p.poll() is None))
        at_client = listening_addresses(os.getpid()) - before
    print(f"\nlistening while bound: workers {at_worker}, client {at_client} ({loopback} = 127.0.0.1)")
    assert at_worker and at_worker <= {loopback}
    assert at_client <= {loopback}


def test_rendezvous_beyond_loopback_needs_insecure_network(cluster, tiny_target_dir, reference):
    """Protected mode for the NCCL rendezvous, which nothing authenticates: on an address other hosts
    reach, a client refuses enable_nccl and a worker refuses a binding unless told insecure_network; with
    it, both bind there (gloo here), equal to colocated, and the worker warns."""
    net = network_address()
    if net is None:
        pytest.skip("this host has a loopback interface only")
    with pytest.raises(ValueError, match="insecure_network=True") as client_refused:
        RemoteTargetModel(cluster.frontend, advertise_host=net, **NCCL_KW)
    first = len(cluster.workers)
    cluster.start_worker(tiny_target_dir, "--advertise-host", net, service="exposed")
    cluster.start_worker(tiny_target_dir, "--advertise-host", net, "--insecure-network", service="exposed-ok")
    cluster.wait_workers(1, service="exposed")
    with RemoteTargetModel(cluster.frontend, service="exposed", advertise_host=net, **CLIENT_KW) as client:
        client.target_info()
        header = {"reply_to": client._io.data_endpoint, "timeout": 10, "device_type": "cpu"}
        with pytest.raises(Exception, match="protected mode") as worker_refused:
            client._io.submit(ClientCommand.BIND, "exposed", header, (), 10, max_retries=0).result(30)
    cluster.wait_workers(1, service="exposed-ok")
    with RemoteTargetModel(cluster.frontend, service="exposed-ok", advertise_host=net, insecure_network=True,
                           **NCCL_KW) as client:
        check(client, reference, tiny_target_dir, 12, "dspark")
        bound = client.bound_worker
        at_worker = listening_addresses(cluster.workers[first + 1].pid)
    log = (cluster.log_dir / f"worker{first + 1}.log").read_text()
    print(f"\nclient without insecure_network: {str(client_refused.value)[:90]}...\nworker without "
          f"--insecure-network: {str(worker_refused.value)[-150:]}\nwith it: bound {bound}, listening {at_worker}")
    assert bound is not None and "security.insecure_network" in log
    assert at_worker and "0100007F" not in at_worker  # the store and gloo on the advertised address only
