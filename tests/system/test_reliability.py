"""Faults cost at most a retry: slow worker, client death, worker death, broker restart.

One cluster (a broker, one hf worker and one test-only slow worker, real
subprocesses on loopback, short heartbeats) is shared by the tests in file
order. Every result is compared with torch.equal to the colocated HFTarget on
the same directory; each test prints its counts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from cluster_util import (
    CLIENT_KW,
    FAST_ENV,
    HEARTBEAT_INTERVAL,
    HEARTBEAT_LIVENESS,
    Reference,
    Tally,
    assert_contract,
    assert_equal_batches,
    kill,
    rss_kib,
    run_requests,
    start_slow_worker,
    wait_until,
    workers,
)
from spec_serve.client.api import RemoteTargetModel
from spec_serve.tools.launch import local_cluster
from spec_serve.tools.tiny import sample_batch

SLOW_DELAY = 2.0  # 10 heartbeat intervals, twice the liveness window
LIVENESS_WINDOW = HEARTBEAT_INTERVAL * HEARTBEAT_LIVENESS


@pytest.fixture(scope="module")
def cluster(tiny_target_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("reliability-logs")
    with local_cluster(tiny_target_dir, workers=0, env=dict(FAST_ENV), log_dir=log_dir) as c:
        c.start_worker(tiny_target_dir)
        c.wait_workers(1)  # the slow one registers second: tests find it by registration order
        c.slow_worker = start_slow_worker(c, tiny_target_dir, SLOW_DELAY)
        c.wait_workers(2)
        yield c


@pytest.fixture(scope="module")
def reference(tiny_target_dir, tiny_vocab_mapping):
    return Reference(tiny_target_dir, tiny_vocab_mapping)


def _client(cluster, mapping, **kw):
    args = dict(timeout=30.0, max_retries=4, **CLIENT_KW)
    args.update(kw)
    client = RemoteTargetModel(cluster.frontend, **args)
    client.set_vocab_mapping(*mapping)
    return client


def test_a_client_the_broker_forgot_registers_its_mapping_again_before_its_next_request(cluster, reference,
                                                                                       tiny_vocab_mapping):
    """A client whose heartbeats come past the broker's liveness window (a loaded host) is forgotten, its
    mapping with it. Retries off: its next EAGLE-3 request is still served, bit-equal, because it registers
    the mapping again before that request reaches the broker (told so by the broker; or, crossing that
    word, sent again behind the registration at no cost to its retries)."""
    with _client(cluster, tiny_vocab_mapping, max_retries=0) as client:
        assert_equal_batches(client.generate_batch(*reference.batch(40)), reference.expected(40))
        io, late = client._io, threading.Event()
        keep_alive = io._keep_alive
        io._keep_alive = lambda now: None if late.is_set() else keep_alive(now)
        late.set()
        gone = f"broker.client_gone client={io.identity.hex()[:12]}"
        wait_until(lambda: gone in cluster.log_path("broker").read_text(), timeout=30, interval=0.05,
                   what="the broker forgetting the silent client")
        late.clear()
        for seed in (41, 42):
            assert_equal_batches(client.generate_batch(*reference.batch(seed)), reference.expected(seed))


def test_compact_replies_out_of_order_and_across_a_mapping_switch_each_get_their_own_values(
        cluster, tiny_target_dir, tiny_vocab_mapping, colocated_target):
    """Values, not counters. A compact client with prefetch: its requests spread over the slow worker and the
    other one, so replies arrive out of order; the first half name one mapping, the second another (switched
    while the first are in flight; the same draft vocab size, another order). Each batch meets the contract
    with the colocated forward of its own mapping (and, compact, against the full forward: assert_contract).
    A reply handed to another pending request, or an lm_head slice cached under a key both mappings share,
    gives wrong values here, whatever the counters say."""
    other = (tiny_vocab_mapping[0].flip(0), tiny_vocab_mapping[1])
    mappings = (tiny_vocab_mapping, other)
    engines = (colocated_target(), colocated_target(vocab_mapping=other))
    arrived: list[int] = []
    sent = []
    with _client(cluster, tiny_vocab_mapping, compact=True, prefetch_depth=8) as client:
        for which, seeds in enumerate((range(50, 53), range(53, 56))):
            if which:
                client.set_vocab_mapping(*other)
            for seed in seeds:
                batch = sample_batch(tiny_target_dir, 2, 16, seed=seed)
                future = client.generate_batch_async(*batch, kind="eagle3")
                future.add_done_callback(lambda _, seed=seed: arrived.append(seed))
                sent.append((seed, which, batch, future))
        for _, which, batch, future in sent:
            assert_contract(future.result(timeout=120), engines[which], batch, "eagle3", compact=True,
                            selected=mappings[which])
        stats = client.stats
    print(f"\nsent {[s for s, *_ in sent]}, arrived {arrived}")
    assert arrived != sorted(arrived), "every reply came in order: the scenario did not happen"
    assert (stats.compact_replies, stats.lm_head_slices) == (6, 2), stats


def test_slow_worker_is_not_declared_dead(cluster, reference, tiny_vocab_mapping):
    """A forward of 2 s (10 heartbeat intervals) keeps the worker registered."""
    before = {w["id"]: w["registered_at"] for w in workers(cluster)}
    seen_counts: list[int] = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            seen_counts.append(len(workers(cluster)))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    tally = Tally()
    with _client(cluster, tiny_vocab_mapping, prefetch_depth=6) as client:
        run_requests(client, reference, range(100, 112), tally)
        stats = client.stats
    stop.set()
    watcher.join()
    after = {w["id"]: w["registered_at"] for w in workers(cluster)}
    busy = max((w["completed"] for w in workers(cluster)), default=0)
    print(f"\nslow worker: {tally.as_dict()} retried={stats.retried} duplicates={stats.duplicates} "
          f"min_worker_count={min(seen_counts)} polls={len(seen_counts)} max_completed={busy}")
    assert tally.verified == tally.sent == 12, tally.errors
    assert min(seen_counts) == 2, "a slow worker was mistaken for a dead one"
    assert after == before, "a worker re-registered during the slow forwards"
    _, metrics = cluster.get("/metrics")
    deaths = [line for line in metrics.splitlines() if line.startswith("spec_serve_worker_deaths")]
    print("metrics:", deaths)


CLIENT_SCRIPT = textwrap.dedent("""
    import sys, time
    from spec_serve.client.api import RemoteTargetModel
    from spec_serve.tools.tiny import sample_batch
    frontend, target = sys.argv[1], sys.argv[2]
    client = RemoteTargetModel(frontend, prefetch_depth=8, timeout=60, heartbeat_interval=0.2, liveness=15)
    futures = [client.generate_batch_async(*sample_batch(target, 2, 16, seed=s), kind="dspark") for s in range(8)]
    print("SUBMITTED", flush=True)
    time.sleep(600)
""")


def test_client_death_frees_what_it_held(cluster, tiny_target_dir, tiny_vocab_mapping):
    """SIGKILL a client subprocess with 8 requests out: the broker's tables and RSS return to baseline."""
    with _client(cluster, tiny_vocab_mapping) as observer:
        wait_until(lambda: observer.status()["clients"] == 1, timeout=30, what="only the observer connected")
        base = observer.status()
        base_rss = rss_kib(cluster.broker.pid)
        proc = subprocess.Popen([sys.executable, "-c", CLIENT_SCRIPT, cluster.frontend, str(tiny_target_dir)],
                                stdout=subprocess.PIPE, text=True, env={**os.environ, **FAST_ENV})
        try:
            assert proc.stdout.readline().strip() == "SUBMITTED"
            held = wait_until(lambda: (s := observer.status()) and s["inflight"] + s["queued"] > 0 and s,
                              timeout=30, what="the client's requests at the broker")
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        killed_at = time.monotonic()

        last = []

        def back_to_baseline():
            s = observer.status()
            last[:] = [{k: s[k] for k in ("clients", "inflight", "queued")},
                       [(w["id"], w["inflight"], w["completed"]) for w in s["workers"]]]
            return s["clients"] == base["clients"] and s["inflight"] == 0 and s["queued"] == 0 and s

        try:
            final = wait_until(back_to_baseline, timeout=60, interval=0.2, what="broker tables back to baseline")
        except TimeoutError as e:
            raise AssertionError(f"{e}; last status {last}") from None
        freed_s = time.monotonic() - killed_at
        rss = rss_kib(cluster.broker.pid)
    print(f"\nclient death: held inflight={held['inflight']} queued={held['queued']} clients={held['clients']}; "
          f"baseline clients={base['clients']}; after {freed_s:.2f}s inflight={final['inflight']} "
          f"queued={final['queued']} clients={final['clients']}; broker RSS {base_rss} -> {rss} KiB")
    assert rss - base_rss < 20 * 1024, "broker memory grew by more than 20 MiB"


def _redispatched(cluster) -> float:
    _, metrics = cluster.get("/metrics")
    return sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("spec_serve_redispatched_total"))


def test_worker_death_redispatches(cluster, reference, tiny_target_dir, tiny_vocab_mapping):
    """SIGKILL the slow worker while it holds requests, after it answered one: the broker re-dispatches what it
    held (counted) and never what it answered, and every result arrives once (no duplicates) and is correct.
    The client's own retries are off, so only the broker can have recovered them (a broker that dropped them
    would leave the client to time out)."""
    victim = cluster.slow_worker
    tally = Tally()
    redispatched_before = _redispatched(cluster)
    with _client(cluster, tiny_vocab_mapping, prefetch_depth=8, max_retries=0) as client:
        box = {}
        runner = threading.Thread(target=lambda: run_requests(client, reference, range(200, 216), tally))
        runner.start()
        # The slow worker holds requests for 2 s each: kill it once it has answered one (a broker that sent
        # that one again would show in the client's duplicates) and holds more.
        wait_until(lambda: [(w["completed"] > 0, w["inflight"] > 0) for w in
                            sorted(workers(cluster), key=lambda w: w["registered_at"])][-1] == (True, True),
                   timeout=60, interval=0.02, what="slow worker having answered a request and holding more")
        held = sorted(workers(cluster), key=lambda w: w["registered_at"])[-1]["inflight"]
        killed_at = time.monotonic()
        kill(victim)
        wait_until(lambda: len(workers(cluster)) == 1, timeout=10, interval=0.02, what="broker noticing the death")
        box["detect_s"] = time.monotonic() - killed_at
        runner.join(timeout=120)
        assert not runner.is_alive(), "a rank hung"
        stats = client.stats
    cluster.workers.remove(victim)
    redispatched = _redispatched(cluster) - redispatched_before
    print(f"\nworker death: held={held} detection={box['detect_s']:.2f}s (liveness window {LIVENESS_WINDOW:g}s) "
          f"{tally.as_dict()} retried={stats.retried} duplicates_dropped={stats.duplicates} "
          f"redispatched={redispatched:g}")
    assert box["detect_s"] < 10
    assert tally.sent == tally.completed == tally.verified == 16, tally.errors
    assert tally.wrong == 0
    assert stats.retried == 0
    assert stats.duplicates == 0, "a request answered before the death was sent again"
    assert redispatched >= 1, "the broker re-dispatched nothing: the dead worker held no request"


def test_broker_restart(cluster, reference, tiny_target_dir, tiny_vocab_mapping):
    """SIGKILL the broker mid-run and start it on the same ports: the run completes, all correct."""
    cluster.start_worker(tiny_target_dir)  # back to two workers
    cluster.wait_workers(2)
    tally = Tally()
    with _client(cluster, tiny_vocab_mapping, prefetch_depth=4) as client:
        def ranks():
            for start in range(300, 340, 4):
                run_requests(client, reference, range(start, start + 4), tally)

        runner = threading.Thread(target=ranks)
        runner.start()
        wait_until(lambda: tally.completed >= 8, timeout=60, interval=0.02, what="first results")
        old = cluster.broker
        kill(old)
        killed_at = time.monotonic()
        time.sleep(1.0)  # a real restart takes a moment; requests pile up meanwhile
        cluster.start_broker()
        cluster.wait_workers(2, timeout=60)
        rejoin_s = time.monotonic() - killed_at
        runner.join(timeout=180)
        assert not runner.is_alive(), "a rank hung"
        stats = client.stats
    print(f"\nbroker restart: workers rejoined {rejoin_s:.2f}s after the kill; {tally.as_dict()} "
          f"retried={stats.retried} duplicates_dropped={stats.duplicates} reconnects={stats.broker_reconnects}")
    assert tally.sent == tally.completed == tally.verified == 40, tally.errors

