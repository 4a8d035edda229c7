"""The main job with real processes: a broker and two hf workers on loopback, several client ranks.

Every remote tensor is compared with ``torch.equal`` against the colocated ``HFTarget``: unsharded, with
its forward of the batch; sharded, with its forward of each shard's rows (the contract, docs/equality.md:
and the assembled batch bit-equal to the unsharded forward where the kernels are batch-invariant, else
within the derived tolerance). That a batch was really split is checked by counting requests.
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cluster_util import assert_contract, assert_equal_batches, wait_until, workers
from spec_serve.client.api import RemoteTargetModel
from spec_serve.paths.registry import Offers
from spec_serve.protocol import wire
from spec_serve.protocol.commands import Op
from spec_serve.tools.launch import Cluster, local_cluster
from spec_serve.tools.tiny import sample_batch

KINDS = ("eagle3", "dspark")


@pytest.fixture(scope="module")
def cluster(tiny_target_dir):
    with local_cluster(tiny_target_dir, workers=2) as c:
        yield c


@pytest.fixture(scope="module")
def reference(colocated_target):
    return colocated_target()




def run_rank(rank, frontend, tiny_target_dir, mapping, reference, shards, steps=4):
    """One client rank: prefetch 2, alternating kinds; returns (verified, requests sent, stats)."""
    verified = 0
    with RemoteTargetModel(frontend, num_shards=shards, prefetch_depth=2, timeout=60) as target:
        target.set_vocab_mapping(*mapping)
        before = target.stats.sent
        submitted = []
        for step in range(steps):
            inputs = sample_batch(tiny_target_dir, batch=3 + rank, seq=24, seed=100 * rank + step)
            kind = KINDS[step % 2]
            submitted.append((kind, inputs, target.generate_batch_async(*inputs, kind=kind)))
        for kind, inputs, future in submitted:
            assert_contract(future.result(timeout=120), reference, inputs, kind, shards)
            verified += 1
        stats = target.stats
    return verified, stats.sent - before, stats


def _completed(cluster) -> int:
    return sum(w["completed"] for w in workers(cluster))


def test_three_ranks_sharded_and_prefetched_equal_colocated(cluster, tiny_target_dir, tiny_vocab_mapping, reference):
    shards = [1, 2, 2]
    before = _completed(cluster)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda r: run_rank(r, cluster.frontend, tiny_target_dir, tiny_vocab_mapping,
                                                   reference, shards[r]), range(3)))
    print("verified per rank:", [v for v, _, _ in results], "stats:", [s for _, _, s in results])
    assert [v for v, _, _ in results] == [4, 4, 4]
    assert all(s.duplicates == 0 and s.retried == 0 for _, _, s in results)
    # Each batch went out as `shards` requests, and the workers completed exactly those.
    assert [sent for _, sent, _ in results] == [4 * n for n in shards]
    wait_until(lambda: _completed(cluster) - before == 4 * sum(shards), timeout=10,
               what="the broker counting every shard completed")
    # Both workers served: sharded requests spread across them (the shim's snapshot lags a tick).
    wait_until(lambda: all(w["completed"] > 0 for w in workers(cluster)), timeout=10, what="both workers served")


def test_short_rows_sharded_meet_the_contract(cluster, tiny_target_dir, tiny_vocab_mapping, reference):
    """Three two-token rows, sharded in two: the shards' GEMMs have 4 and 2 rows, the whole batch's 6. On
    AVX-512 CPUs with MKL that is a batch-variant composition (a GEMM of a few rows takes another path): each
    shard is still bit-equal to the colocated forward of its rows, and the assembled batch lies within the
    derived tolerance of the unsharded forward (bit-equal where the kernels are batch-invariant)."""
    batch = sample_batch(tiny_target_dir, batch=3, seq=2, seed=3)
    before = _completed(cluster)
    verdicts = []
    for compact in (False, True):
        # The compact client on frames: its received tensors are views of frames, not 64-byte aligned.
        with RemoteTargetModel(cluster.frontend, num_shards=2, compact=compact, same_host_plane=not compact,
                               timeout=60) as target:
            target.set_vocab_mapping(*tiny_vocab_mapping)
            sent = target.stats.sent
            for kind in ("dspark", "eagle3") if not compact else ("eagle3",):
                check = assert_contract(target.generate_batch(*batch, kind=kind), reference, batch, kind, 2,
                                        compact=compact, selected=tiny_vocab_mapping)
                verdicts.append(f"{kind}{'_compact' if compact else ''}: {check.describe()}")
            assert target.stats.sent - sent == 2 * (1 if compact else 2)
    print("\n" + "\n".join(verdicts))
    # 3 batches of 2 shards, and the compact client's lm_head slice.
    wait_until(lambda: _completed(cluster) - before == 7, timeout=10, what="the broker counting 6 shards and 1 slice")


def test_embeddings_and_target_info(cluster, reference):
    with RemoteTargetModel(cluster.frontend, timeout=60) as target:
        assert target.target_info() == reference.target_info()
        target.check_target_info(reference.target_info())
        assert torch.equal(target.get_input_embeddings().weight, reference.get_input_embeddings().weight)
        assert torch.equal(target.get_output_embeddings().weight, reference.get_output_embeddings().weight)


def test_mismatched_target_info_names_worker_and_fields(cluster, reference):
    expected = dict(reference.target_info().to_dict(), hidden_size=4096, aux_layer_ids=[2, 16, 29])
    with RemoteTargetModel(cluster.frontend, timeout=60) as target:
        with pytest.raises(ValueError) as err:
            target.check_target_info(expected)
    message = str(err.value)
    assert "worker " in message and "hidden_size" in message and "aux_layer_ids" in message
    assert "4096" in message


def test_unknown_service_is_a_clear_error(cluster, tiny_target_dir):
    inputs = sample_batch(tiny_target_dir, batch=1, seq=8, seed=0)
    with RemoteTargetModel(cluster.frontend, service="no-such-target", timeout=3, max_retries=0) as target:
        # target_info() of a service no worker serves times out clearly.
        with pytest.raises(TimeoutError, match="no-such-target"):
            target.target_info()
        # A raw request (bypassing the info lookup) gets the broker's error reply: its deadline (2 s) passes
        # long before the client's own wait (10 s), whose "no reply within" must not be what is raised.
        target._info = None
        target.timeout = 10.0
        future = target._submit(target._request(Op.GENERATE, Offers(), kind="dspark", timeout=2), [])
        with pytest.raises((ValueError, TimeoutError), match="no worker of 'no-such-target' took the request "
                                                             "before its deadline|unknown service 'no-such-target'"):
            future.result(timeout=30)
    del inputs


def test_bad_request_is_refused_and_worker_keeps_serving(cluster, tiny_target_dir, tiny_vocab_mapping, reference):
    with RemoteTargetModel(cluster.frontend, timeout=60) as target:
        ids, attn, loss = sample_batch(tiny_target_dir, batch=2, seq=8, seed=3)
        with pytest.raises(ValueError, match="token ids"):
            target.generate_batch(ids + 10_000, attn, loss, kind="dspark")
        with pytest.raises(RuntimeError, match="set_vocab_mapping"):
            target.generate_batch(ids, attn, loss, kind="eagle3")
        with pytest.raises(ValueError, match="shape"):
            target.generate_batch(ids, attn[:, :4], loss, kind="dspark")
        # Past the client's own checks: the worker refuses a request with a foreign tensor set.
        future = target._submit(target._request(Op.GENERATE, Offers(), kind="dspark", timeout=60),
                                wire.encode({"input_ids": ids, "labels": ids}))
        with pytest.raises(ValueError, match="request must hold"):
            future.result(timeout=60)
        assert_equal_batches(target.generate_batch(ids, attn, loss, kind="dspark"),
                             reference.generate_batch(ids, attn, loss, kind="dspark"))


def test_closing_one_client_leaves_others_served(cluster, tiny_target_dir, tiny_vocab_mapping, reference):
    inputs = sample_batch(tiny_target_dir, batch=2, seq=16, seed=11)
    a = RemoteTargetModel(cluster.frontend, timeout=60)
    b = RemoteTargetModel(cluster.frontend, timeout=60)
    try:
        a.set_vocab_mapping(*tiny_vocab_mapping)
        b.set_vocab_mapping(*tiny_vocab_mapping)
        pending = a.generate_batch_async(*inputs, kind="eagle3")
        a.close()  # closing with a request in flight: it completes or fails, it never hangs
        try:
            assert_equal_batches(pending.result(timeout=30), reference.generate_batch(*inputs, kind="eagle3"))
        except RuntimeError as e:
            assert "closed" in str(e)
        for _ in range(3):
            assert_equal_batches(b.generate_batch(*inputs, kind="eagle3"),
                                 reference.generate_batch(*inputs, kind="eagle3"))
        code, health = cluster.get("/health")
        assert code == 200 and health["workers"] == 2
    finally:
        a.close()
        b.close()


def test_two_clients_with_different_vocab_mappings(cluster, tiny_target_dir, tiny_vocab_mapping, colocated_target):
    """No request is ever answered with another client's mapping."""
    ids_a, mask_a = tiny_vocab_mapping
    ids_b = torch.arange(0, 512, 4, dtype=torch.int64)
    mask_b = torch.zeros(512, dtype=torch.bool)
    mask_b[ids_b] = True
    ref_a, ref_b = colocated_target(), colocated_target(vocab_mapping=(ids_b, mask_b))
    inputs = sample_batch(tiny_target_dir, batch=2, seq=16, seed=5)
    with RemoteTargetModel(cluster.frontend, timeout=60) as a, RemoteTargetModel(cluster.frontend, timeout=60) as b:
        a.set_vocab_mapping(ids_a, mask_a)
        b.set_vocab_mapping(ids_b, mask_b)
        futures = []
        for _ in range(3):
            futures.append((ref_a, a.generate_batch_async(*inputs)))
            futures.append((ref_b, b.generate_batch_async(*inputs)))
        for ref, future in futures:
            assert_equal_batches(future.result(timeout=120), ref.generate_batch(*inputs, kind="eagle3"))


def _metrics_once_counted(cluster: Cluster, metrics: tuple[str, ...], timeout: float = 60) -> str:
    """/metrics once the broker counted a DONE. The reply reaches the client before the worker's DONE
    reaches the broker, and the shim may scrape between the broker's updates of one DONE (tokens, bytes,
    latency): wait for every metric named, up to ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        code, text = cluster.get("/metrics")
        assert code == 200
        counted = [line for line in text.splitlines() if line.startswith("spec_serve_tokens_total")]
        done = counted and float(counted[0].split()[-1]) > 0 and all(m in text for m in metrics)
        if done or time.monotonic() > deadline:
            return text
        time.sleep(0.1)


def test_readiness_goes_503_to_200_and_metrics(tiny_target_dir):
    """/health (liveness) answers 200 throughout; /ready is 503 until a worker registers, and again once it died."""
    cluster = Cluster.on_free_ports()
    try:
        cluster.start_broker()
        code, body = cluster.get("/ready")
        assert code == 503, body
        assert cluster.get("/health")[0] == 200
        cluster.start_worker(tiny_target_dir)
        cluster.wait_workers(1)
        code, body = cluster.get("/ready")
        assert code == 200 and body["workers"] == 1, body
        code, info = cluster.get("/model_info?service=default")
        assert code == 200 and info["engine"] == "hf" and info["num_hidden_layers"] == 8
        assert cluster.get("/model_info?service=nope")[0] == 404
        assert cluster.get("/nope")[0] == 404
        with RemoteTargetModel(cluster.frontend, timeout=60) as target:
            inputs = sample_batch(tiny_target_dir, batch=2, seq=8, seed=1)
            target.generate_batch(*inputs, kind="dspark")
        metrics = ("spec_serve_requests_total", "spec_serve_tokens_total", "spec_serve_reply_bytes_total",
                   "spec_serve_request_latency_seconds_bucket", "spec_serve_queue_depth", "spec_serve_worker_inflight")
        text = _metrics_once_counted(cluster, metrics)
        for metric in metrics:
            assert metric in text, metric
        tokens = [line for line in text.splitlines() if line.startswith("spec_serve_tokens_total")]
        assert tokens and float(tokens[0].split()[-1]) == float(inputs[1].sum())
        # The status command prints the same picture.
        out = subprocess.run([sys.executable, "-m", "spec_serve.tools.cli", "status", "--broker", cluster.frontend,
                              "--json"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        status = json.loads(out.stdout)
        assert status["services"]["default"]["workers"] == 1
        # Kill the only worker: readiness falls back to 503 once the broker notices; the broker stays alive.
        cluster.workers[0].kill()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and cluster.get("/ready")[0] != 503:
            time.sleep(0.2)
        assert cluster.get("/ready")[0] == 503 and cluster.get("/health")[0] == 200
    finally:
        cluster.stop()


def _listening_addresses(port: int) -> set[str]:
    """The IPv4 addresses a TCP socket of this host listens on at ``port`` (Linux /proc/net/tcp)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
            found.add(".".join(str(b) for b in reversed(bytes.fromhex(address))))
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux /proc/net/tcp")
def test_http_shim_binds_loopback_by_default():
    """The broker started without --http-host: its shim listens on 127.0.0.1 and nowhere else."""
    cluster = Cluster.on_free_ports()
    try:
        cluster.start_broker()
        assert cluster.get("/health")[0] in (200, 503)
        assert _listening_addresses(cluster.http_port) == {"127.0.0.1"}
    finally:
        cluster.stop()


def test_readiness_counts_only_services_in_use_that_had_workers():
    from spec_serve.broker.status import health, ready

    def svc(ready, ever=True, in_use=True, queued=0):
        return {"workers": ready, "ready_workers": ready, "queue_depth": queued, "ever_had_workers": ever,
                "in_use": in_use}

    alive = {"age_s": 0.1, "stall_s": 10.0}
    snap = {"workers": [{}], "loop": alive,
            "services": {"default": svc(1), "typo": svc(0, ever=False, queued=3), "stray": svc(0, in_use=False)}}
    assert ready(snap)[0] == 200  # a name only clients asked for, or one nobody uses, does not turn it red
    assert ready(snap, "stray")[0] == 503 and ready(snap, "default")[0] == 200 and ready(snap, "nope")[0] == 503
    snap["services"]["default"] = svc(0)
    assert ready(snap)[0] == 503  # a service in use without a ready worker does
    assert ready({"workers": [], "services": {}, "loop": alive})[0] == 503
    assert health({"workers": [], "services": {}, "loop": alive})[0] == 200  # alive with no worker at all
    assert health({**snap, "loop": {"age_s": 11.0, "stall_s": 10.0}}) == (503, {"status": "stalled",
                                                                            "loop_age_s": 11.0, "workers": 1})
    assert health({**snap, "loop": {"age_s": None, "stall_s": 10.0}})[1]["status"] == "stopped"
    assert ready({**snap, "services": {"default": svc(1)}, "loop": {"age_s": 11.0, "stall_s": 10.0}})[0] == 503
