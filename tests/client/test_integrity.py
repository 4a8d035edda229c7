"""End-to-end integrity (issue 12): no wrong tensor ever reaches a trainer, and the target cannot
change under a client. Real broker and worker processes on the tiny target.

Workers started with the test-only ``SPEC_SERVE_TEST_CORRUPT_REPLIES=N`` flip one bit of their next
N generate replies *after* the reply's digest was taken on the worker's device, as a reused slab,
a stale receive buffer or a bad link would: each flip in another tensor of the reply, at an offset
spread over it (most far past its first 4 KiB). Every check runs on each path a reply can take to a
client of this host: frames (the same-host plane off) and the same-host plane; and over the NCCL pair
group (gloo). A second tiny target with another seed (same architecture and name, another
fingerprint) plays the other checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import subprocess

import pytest
from prometheus_client import REGISTRY

from cluster_util import (
    FORGIVING_CLIENT_KW,
    FORGIVING_ENV,
    assert_contract,
    assert_equal_batches,
    same,
    start_swap_worker,
    wait_until,
    workers,
)
from spec_serve.client.api import IntegrityError, RemoteTargetModel, TargetChangedError
from spec_serve.paths.registry import Offers
from spec_serve.protocol.commands import Op
from spec_serve.tools.launch import local_cluster
from spec_serve.tools.tiny import make_tiny_target, sample_batch
from spec_serve.tools.verify import colocated_reference, full_reference_violations

ENV = FORGIVING_ENV
CLIENT_KW = FORGIVING_CLIENT_KW
ALWAYS = "1000000"


@pytest.fixture(scope="module")
def other_target_dir(tmp_path_factory):
    """The tiny target's architecture and name with seed 1: another checkpoint, another fingerprint."""
    return make_tiny_target(tmp_path_factory.mktemp("other") / "tiny-llama", seed=1)


def start_worker(cluster, target, service: str, corrupt: str | None = None) -> tuple[subprocess.Popen, str]:
    """A worker (corrupting its next ``corrupt`` replies) and the name of its log file."""
    cluster.env = {**ENV, "SPEC_SERVE_TEST_CORRUPT_REPLIES": corrupt} if corrupt else dict(ENV)
    name = f"worker{len(cluster.workers)}"
    try:
        return cluster.start_worker(target, service=service), name
    finally:
        cluster.env = dict(ENV)


@pytest.fixture(scope="module")
def cluster(tiny_target_dir, tmp_path_factory):
    """flaky: one worker corrupting every reply and one sound; bad: one corrupting every reply;
    once: one corrupting its first reply only; swap: one sound worker (killed by a test)."""
    with local_cluster(tiny_target_dir, workers=0, env=ENV, log_dir=tmp_path_factory.mktemp("integrity-logs")) as c:
        for service, corrupt in [("flaky", ALWAYS), ("flaky", None), ("bad", ALWAYS), ("once", "1"), ("swap", None)]:
            start_worker(c, tiny_target_dir, service, corrupt)
        for service, count in [("flaky", 2), ("bad", 1), ("once", 1), ("swap", 1)]:
            c.wait_workers(count, service=service)
        yield c


@pytest.fixture(scope="module")
def reference(colocated_target):
    return colocated_target()


@pytest.fixture(autouse=True)
def _verify_default(monkeypatch):
    monkeypatch.delenv("SPEC_SERVE_VERIFY", raising=False)


def inputs(target_dir, seed: int, batch: int = 4, seq: int = 16):
    return sample_batch(target_dir, batch, seq, seed=seed)


PATHS = ("frames", "plane")


def path_kw(path: str) -> dict:
    """The client options that make replies reach it by ``path``, and its usual options."""
    return {"same_host_plane": path == "plane", **CLIENT_KW}


def assert_path(stats, path: str) -> None:
    """The replies really came by ``path``: frames carry EAGLE-3 compact (compact="auto"), the plane full."""
    assert (stats.plane_replies > 0) if path == "plane" else (stats.plane_replies == 0), (path, stats)
    assert (stats.compact_replies > 0) == (path == "frames"), (path, stats)


def as_received(path: str, mapping) -> dict:
    """The contract's options for an EAGLE-3 batch that came by ``path`` (``assert_contract``,
    ``colocated_reference``): over frames compact, expanded here with the draft-vocab ``mapping``."""
    return {"compact": True, "selected": mapping} if path == "frames" else {}


def corruptions(cluster, worker: str) -> list[tuple[str, int]]:
    """(tensor, byte offset) of each flip ``worker`` made, from its log."""
    text = (cluster.log_dir / f"{worker}.log").read_text()
    return [(line.split("tensor=")[1].split()[0], int(line.split("offset=")[1].split()[0]))
            for line in text.splitlines() if "worker.test_corruption" in line]


def failures(service: str, check: str) -> float:
    return REGISTRY.get_sample_value("spec_serve_client_integrity_failures_total",
                                     {"service": service, "check": check}) or 0.0


def wait_exit(proc: subprocess.Popen, timeout: float = 120) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the worker is still running after {timeout:g}s: the broker did not refuse it")


# ------------------------------------------------------------------------------------ digests


@pytest.mark.parametrize("path", PATHS)
def test_corrupted_replies_are_retried_on_the_other_worker_and_never_returned(cluster, tiny_target_dir,
                                                                              tiny_vocab_mapping, reference, caplog,
                                                                              path):
    before = failures("flaky", "digest")
    with caplog.at_level(logging.ERROR, logger="spec_serve.client"), \
            RemoteTargetModel(cluster.frontend, service="flaky", num_shards=2, prefetch_depth=2,
                              **path_kw(path)) as client:
        assert client.verify == "all"
        client.set_vocab_mapping(*tiny_vocab_mapping)
        batches = [inputs(tiny_target_dir, seed) for seed in range(6)]
        futures = [client.generate_batch_async(*x) for x in batches]
        for x, future in zip(batches, futures):
            assert_contract(future.result(timeout=120), reference, x, "eagle3", shards=2,
                            **as_received(path, tiny_vocab_mapping))
        stats = client.stats
    assert_path(stats, path)
    # 6 batches x 2 shards, both workers busy: the corrupting one answered some. Each of its replies was
    # caught and retried on the sound worker (a retry on the corrupting one would have failed the batch).
    assert stats.digest_mismatches >= 1, stats
    # Compact replies (frames) also had the lm_head slice they needed fetched and checked, once.
    assert stats.digest_checks == 12 + stats.digest_mismatches + stats.lm_head_slices, stats
    assert stats.lm_head_slices == (path == "frames"), stats
    assert failures("flaky", "digest") - before == stats.digest_mismatches
    lines = [r.getMessage() for r in caplog.records if "client.digest_mismatch" in r.getMessage()]
    assert len(lines) == stats.digest_mismatches  # captured at ERROR
    corrupting = {line.split("worker=")[1].split()[0] for line in lines}
    assert len(corrupting) == 1 and all("request=" in line and "retry=True" in line for line in lines), lines
    # Each caught flip is named by the tensor it hit; the flips spread over tensors and far into them.
    flips = corruptions(cluster, "worker0")
    assert {line.split("tensors=")[1].split()[0] for line in lines} <= {name for name, _ in flips}
    assert any(offset >= 4096 for _, offset in flips), flips
    print(f"\n{path}: {stats.digest_mismatches} corrupted replies caught and retried; flips so far {flips}")


@pytest.mark.parametrize("path", PATHS)
def test_a_second_mismatch_fails_the_batch_with_a_clear_error(cluster, tiny_target_dir, tiny_vocab_mapping, path):
    with RemoteTargetModel(cluster.frontend, service="bad", **path_kw(path)) as client:
        client.set_vocab_mapping(*tiny_vocab_mapping)
        with pytest.raises(IntegrityError, match="on the retry too") as error:
            client.generate_batch(*inputs(tiny_target_dir, 10))
        # Over frames the lm_head slice came first (compact="auto" fetches it before a frames-only request), checked.
        assert client.stats.lm_head_slices == (path == "frames"), client.stats
        assert client.stats.digest_mismatches == 2, client.stats
        assert client.stats.digest_checks == 2 + client.stats.lm_head_slices, client.stats
        assert_path(client.stats, path)
    print(f"\n{error.value}")


@pytest.mark.parametrize("path", PATHS)
def test_verify_off_skips_the_check(cluster, tiny_target_dir, tiny_vocab_mapping, reference, path):
    # Full replies on both paths (compact=False): every tensor reaches the caller as it came, so any flip shows.
    with RemoteTargetModel(cluster.frontend, service="bad", verify="off", **{**path_kw(path), "compact": False}) \
            as client:
        client.set_vocab_mapping(*tiny_vocab_mapping)
        x = inputs(tiny_target_dir, 11)
        got = client.generate_batch(*x)
        # Unchecked, the corrupted reply reaches the caller: what "off" gives up.
        assert not same(got, reference.generate_batch(*x))
        assert client.stats.digest_checks == 0 and client.stats.digest_mismatches == 0
        assert (client.stats.plane_replies > 0) == (path == "plane") and client.stats.compact_replies == 0


def test_verify_sampled_checks_one_request_in_eight(cluster, tiny_target_dir, tiny_vocab_mapping, monkeypatch):
    monkeypatch.setenv("SPEC_SERVE_VERIFY", "sampled")
    with RemoteTargetModel(cluster.frontend, service="bad", **CLIENT_KW) as client:
        assert client.verify == "sampled"
        client.set_vocab_mapping(*tiny_vocab_mapping)
        caught = []
        for i in range(10):
            try:
                client.generate_batch(*inputs(tiny_target_dir, 20 + i, batch=1))
            except IntegrityError:
                caught.append(i)
        assert caught == [0, 8]  # the 1st and 9th request are checked (each also retried once)
        assert client.stats.digest_checks == 4 and client.stats.digest_mismatches == 4, client.stats
    monkeypatch.setenv("SPEC_SERVE_VERIFY", "some")
    with pytest.raises(ValueError, match="SPEC_SERVE_VERIFY"):
        RemoteTargetModel(cluster.frontend, service="bad", **CLIENT_KW)


def test_corrupted_nccl_reply_is_caught_and_resent_as_frames(cluster, tiny_target_dir, tiny_vocab_mapping,
                                                             reference):
    """gloo on CPU: the pair group's receive lands the corrupted bytes; the check sees them there."""
    with RemoteTargetModel(cluster.frontend, service="once", enable_nccl=True, nccl_timeout=20,
                           **CLIENT_KW) as client:
        client.set_vocab_mapping(*tiny_vocab_mapping)
        x = inputs(tiny_target_dir, 30)
        # Received over the group, mismatched, binding dropped, re-sent as frames to the (now sound) worker;
        # frames leave the pair group's host-local rule, so compact="auto" has the retry answered compact
        # (one more digest check: the lm_head slice it fetched to expand it), bit-equal to the colocated
        # compact batch expanded, and to the full one within one GEMM's rounding (docs/equality.md): a reference
        # the client's expansion has no part in.
        got = client.generate_batch(*x)
        want = colocated_reference(reference, x, "eagle3", compact=True, selected=tiny_vocab_mapping)
        assert_equal_batches(got, want)
        assert full_reference_violations(got, reference, x) == []
        stats = client.stats
        assert (stats.nccl_batches, stats.digest_mismatches, stats.digest_checks) == (1, 1, 3), stats
        assert (stats.compact_replies, stats.lm_head_slices) == (1, 1), stats
        (flip,) = corruptions(cluster, "worker3")  # "once": one flip, far past the tensor's first 4 KiB
        assert flip[0] == "aux_hidden_states" and flip[1] >= 4096, flip
        x = inputs(tiny_target_dir, 31)
        assert_equal_batches(client.generate_batch(*x), reference.generate_batch(*x))
        assert client.stats.nccl_batches == 2 and client.bound_worker is not None  # bound again


# ------------------------------------------------------------------------------- fingerprints


def test_reply_from_a_target_swapped_in_place_is_never_returned(cluster, tiny_target_dir, other_target_dir,
                                                                tiny_vocab_mapping, reference):
    """The broker knows the worker by its registration; only the reply's fingerprint tells."""
    start_swap_worker(cluster, tiny_target_dir, other_target_dir, after=1, service="inplace")
    cluster.wait_workers(1, service="inplace")
    before = failures("inplace", "fingerprint")
    with RemoteTargetModel(cluster.frontend, service="inplace", **CLIENT_KW) as client:
        client.set_vocab_mapping(*tiny_vocab_mapping)
        ours = client.target_info().fingerprint
        x = inputs(tiny_target_dir, 40)
        assert_equal_batches(client.generate_batch(*x), reference.generate_batch(*x))
        with pytest.raises(TargetChangedError) as error:
            client.generate_batch(*inputs(tiny_target_dir, 41))
        worker = workers(cluster, "inplace")[0]["id"]
        assert ours in str(error.value) and worker in str(error.value)
        theirs = str(error.value).split("serves target fingerprint ")[1].split(",")[0]
        assert len(theirs) == 32 and theirs != ours
        assert client.stats.target_mismatches == 1
    assert failures("inplace", "fingerprint") - before == 1
    print(f"\n{error.value}")


def test_broker_refuses_a_worker_of_another_target(cluster, tiny_target_dir, other_target_dir, tiny_vocab_mapping):
    proc, log = start_worker(cluster, other_target_dir, "bad")
    assert wait_exit(proc) == 1
    text = (cluster.log_dir / f"{log}.log").read_text()
    lines = [line for line in text.splitlines() if "refused" in line]
    assert any("ERROR" in line and "worker.refused" in line for line in lines), text[-2000:]
    assert any(line.startswith("Error: the broker refused this worker: service 'bad' is served by another "
                               "target") and "fingerprint" in line for line in lines), text[-2000:]
    assert len(workers(cluster, "bad")) == 1
    assert "broker.worker_refused" in (cluster.log_dir / "broker.log").read_text()
    # A request naming another fingerprint than the service's workers serve is refused at once.
    with RemoteTargetModel(cluster.frontend, service="bad", max_retries=0, **CLIENT_KW) as client:
        header = dataclasses.replace(client._request(Op.GENERATE, Offers(), kind="dspark", timeout=10),
                                     fingerprint="0" * 32)
        with pytest.raises(TargetChangedError, match="now serves target fingerprint"):
            client._submit(header, []).result(timeout=10)


def test_the_target_cannot_change_under_a_client(cluster, tiny_target_dir, other_target_dir, tiny_vocab_mapping,
                                                 reference):
    """The issue's scenario: a client sets up, its worker leaves, a worker of another checkpoint registers
    under the same service. The broker refuses it while the client is known; the client's batches wait
    for a worker of its own target and come back equal to it."""
    with RemoteTargetModel(cluster.frontend, service="swap", prefetch_depth=2, **CLIENT_KW) as client:
        client.set_vocab_mapping(*tiny_vocab_mapping)
        ours = client.target_info().fingerprint
        client.check_target_info({"fingerprint": ours})
        x = inputs(tiny_target_dir, 50)
        assert_equal_batches(client.generate_batch(*x), reference.generate_batch(*x))
        first = next(p for p in cluster.workers if p.args[p.args.index("--service") + 1] == "swap")
        first.send_signal(signal.SIGKILL)
        first.wait()
        wait_until(lambda: not workers(cluster, "swap"), timeout=30, what="the worker of swap expired")
        other, log = start_worker(cluster, other_target_dir, "swap")
        pending = [client.generate_batch_async(*inputs(tiny_target_dir, s)) for s in (51, 52)]
        assert wait_exit(other) == 1
        assert f"set up with target fingerprint {ours}" in (cluster.log_dir / f"{log}.log").read_text()
        assert not any(f.done() for f in pending), [f.exception() for f in pending if f.done()]
        start_worker(cluster, tiny_target_dir, "swap")
        for s, future in zip((51, 52), pending):
            assert_equal_batches(future.result(timeout=120), reference.generate_batch(*inputs(tiny_target_dir, s)))
        assert client.stats.target_mismatches == 0

