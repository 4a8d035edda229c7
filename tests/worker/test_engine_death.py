"""A worker whose engine dies leaves the pool; the client hears it from that worker at once.

Real broker and `spec-serve worker` processes on loopback. The hf engine is made to "die" by its
test-only fault hook (SPEC_SERVE_TEST_ENGINE_FAULT: a forward raises what a CUDA out-of-memory or
CUDA error raises), which the worker must treat as fatal exactly as it would on a GPU.
"""

from __future__ import annotations

import re
import signal
import time

import pytest

from cluster_util import Reference, assert_equal_batches, wait_until
from spec_serve.client.api import RemoteError, RemoteTargetModel
from spec_serve.engines.hf import TEST_FAULT_ENV
from spec_serve.tools.launch import local_cluster

# A worker is declared dead after 10 s of silence: longer than the test keeps the doomed one stopped.
SLOW_HEARTBEATS = {"SPEC_SERVE_HEARTBEAT_INTERVAL": "0.5", "SPEC_SERVE_HEARTBEAT_LIVENESS": "20",
                   "SPEC_SERVE_UNKNOWN_SERVICE_GRACE": "120", "SPEC_SERVE_LOG_LEVEL": "INFO"}


@pytest.fixture(scope="module")
def cluster(tiny_target_dir, tmp_path_factory):
    with local_cluster(tiny_target_dir, workers=0, env=dict(SLOW_HEARTBEATS),
                       log_dir=tmp_path_factory.mktemp("engine-death-logs")) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_target_dir, tiny_vocab_mapping):
    return Reference(tiny_target_dir, tiny_vocab_mapping)


def _exit_line(cluster, proc) -> str:
    """The last line the worker process wrote (its one-line error)."""
    name = f"worker{cluster.workers.index(proc)}"
    return cluster.log_path(name).read_text().strip().splitlines()[-1]


def _metric(cluster, name: str) -> float:
    _, text = cluster.get("/metrics")
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_probe_failure_exits_before_registering(cluster, tiny_target_dir):
    """An engine that fails the load-time forward never registers; one line says why."""
    proc = cluster.start_worker(tiny_target_dir, env={TEST_FAULT_ENV: "cuda:1"})
    assert proc.wait(timeout=120) == 1
    line = _exit_line(cluster, proc)
    assert line.startswith("Error: the hf engine failed its load-time probe") and "AcceleratorError" in line
    assert "illegal memory access" in line
    _, body = cluster.get("/workers")
    assert body["workers"] == []
    assert "worker_ready" not in cluster.log_path("broker").read_text()


def test_dead_engine_fails_its_request_and_its_others_go_elsewhere(cluster, reference, tiny_target_dir):
    """The request whose forward met the dead engine fails with RemoteError naming the worker and the
    error (not retried); the worker leaves the pool (exit 1, LEAVE); the other request it held is
    re-dispatched, and every other request is answered, bit-equal to the colocated forward."""
    doomed = cluster.start_worker(tiny_target_dir, env={TEST_FAULT_ENV: "oom:2"})  # forward 1 is the probe
    wait_until(lambda: cluster.get("/workers")[1]["workers"], timeout=120, what="the doomed worker registered")
    with RemoteTargetModel(cluster.frontend, timeout=120, max_retries=3, prefetch_depth=4) as client:
        doomed_id = client.status()["workers"][0]["id"]
        client.target_info()
        doomed.send_signal(signal.SIGSTOP)  # so that it holds two requests when it meets its first
        try:
            futures = [client.generate_batch_async(*reference.batch(seed), kind="dspark") for seed in range(4)]
            wait_until(lambda: [w["inflight"] for w in client.status()["workers"]] == [2], timeout=5,
                       what="the doomed worker holding two requests")
        finally:
            doomed.send_signal(signal.SIGCONT)
        continued = time.monotonic()
        with pytest.raises(RemoteError) as failed:
            futures[0].result(timeout=60)
        assert time.monotonic() - continued < 30  # at once, not after retries and timeouts
        assert f"worker {doomed_id}" in str(failed.value) and "OutOfMemoryError" in str(failed.value)
        assert doomed.wait(timeout=60) == 1
        assert _exit_line(cluster, doomed).startswith(f"Error: worker {doomed_id} left the pool: its hf engine "
                                                      f"died: OutOfMemoryError")
        assert f"broker.worker_gone worker={doomed_id} service=default reason='left: OutOfMemoryError" in \
            cluster.log_path("broker").read_text()
        assert _metric(cluster, "spec_serve_redispatched_total") == 1
        cluster.start_worker(tiny_target_dir)  # a healthy one serves the rest
        for seed, future in enumerate(futures[1:], start=1):
            assert_equal_batches(future.result(timeout=120), reference.expected(seed, kind="dspark"))
        assert client.stats.retried == 0
        assert client.stats.duplicates == 0  # nothing answered was sent again


def test_errors_the_engine_survives_keep_the_worker_and_end_in_remote_error(cluster, reference, tiny_target_dir):
    """A forward that fails without killing the engine is retried; when every attempt failed the client
    gets RemoteError with the worker's error (not TimeoutError: nothing timed out), and the worker stays."""
    flaky = cluster.start_worker(tiny_target_dir, env={TEST_FAULT_ENV: "error:2"}, service="flaky")
    wait_until(lambda: any(w["service"] == "flaky" for w in cluster.get("/workers")[1]["workers"]), timeout=120,
               what="the flaky worker registered")
    with RemoteTargetModel(cluster.frontend, service="flaky", timeout=120, max_retries=1) as client:
        with pytest.raises(RemoteError, match=r"failed after 2 attempts: worker \w+: RuntimeError: a forward failed"):
            client.generate_batch(*reference.batch(0), kind="dspark")
        assert client.stats.retried == 1
    assert flaky.poll() is None
    assert [w["service"] for w in cluster.get("/workers")[1]["workers"]].count("flaky") == 1
