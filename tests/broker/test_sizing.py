"""Supply and demand, socket-free: the sizing rule (broker/sizing.py) on figures, the broker's measure of them
(broker/supply.py) from the events a router sees, clients' reports that cannot be true, and a rank's meter
(client/demand.py). The same with real processes: tests/system/test_sizing_cluster.py."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import threading
import time
import types

import pytest

from broker_util import SERVICE, done, handle, make_router, new_request_id, ready, submit
from spec_serve.broker.sizing import ADD, BALANCED, IDLE, REMOVE, UNKNOWN, Figures, Window, advise, percentiles
from spec_serve.client.demand import DemandMeter, metered
from spec_serve.client.stats import ClientStats
from spec_serve.protocol.commands import CLIENT_TAG, ClientCommand
from spec_serve.protocol.messages import ClientHeartbeat


def figures(workers: int = 3, demand: float = 1000.0, supply: float = 500.0, busy: float = 0.5,
            wait: float | None = 0.0, ranks: int = 2) -> Figures:
    return Figures(seconds=60.0, span=60.0, workers=workers, demand_tps=demand, ranks=ranks,
                   supply_tps=(supply,) * workers, busy=(busy,) * workers, wait=wait)


# ------------------------------------------------------------------ the rule


def test_trainers_waiting_on_busy_workers_need_more_workers():
    # 3 workers busy 99% deliver 3 x 0.99 x 1000 tokens/s; trainers wait 31% of each step, so unthrottled they
    # would ask 2970 / 0.69 = 4304 tokens/s: 4.3 workers' worth.
    advice = advise(figures(demand=2970.0, supply=1000.0, busy=0.99, wait=0.31))
    assert advice.action == ADD and advice.workers_needed == 5
    assert advice.line.startswith("add 2 workers: trainers wait 31% of each step, workers busy 99%")
    assert advice.need == pytest.approx(2970 / 0.69 / 1000)


def test_prefetch_hides_saturation_balanced_not_add():
    """Trainers that prefetch wait 0% while the workers are saturated: they get all they ask, no more workers."""
    advice = advise(figures(demand=3000.0, supply=1000.0, busy=1.0, wait=0.0))
    assert advice.action == BALANCED and advice.workers_needed == 3
    assert "trainers wait 0%" in advice.line and "workers busy 100%" in advice.line


def test_idle_workers_fewer_would_do():
    advice = advise(figures(demand=840.0, supply=1000.0, busy=0.28, wait=0.0))
    assert advice.action == REMOVE and advice.workers_needed == 1
    assert advice.line.startswith("1 of 3 workers would do: busy 28%")


def test_remove_keeps_headroom():
    """0.95 workers' worth of demand keeps 2 of 3 (one would be saturated at once)."""
    advice = advise(figures(demand=950.0, supply=1000.0, busy=0.32, wait=0.0))
    assert advice.action == REMOVE and advice.workers_needed == 2


def test_latency_bound_wait_says_prefetch_not_workers():
    """One rank without prefetch waits for each request while its worker idles half the time: more workers
    would not help, prefetch would."""
    advice = advise(figures(workers=1, demand=250.0, supply=1000.0, busy=0.25, wait=0.5, ranks=1))
    assert advice.action == BALANCED and "raise prefetch_depth" in advice.line


def test_within_noise_is_balanced():
    advice = advise(figures(demand=3000.0 * 1.03 * 0.9, supply=1000.0, busy=1.0, wait=0.1))
    assert advice.action == BALANCED


def test_no_demand_no_supply_no_workers():
    assert advise(figures(demand=0.0, ranks=0)).action == IDLE
    assert advise(figures(demand=0.0, ranks=0)).workers_needed == 0
    none_done = Figures(seconds=60.0, span=60.0, workers=2, demand_tps=500.0, ranks=1, supply_tps=(None, None),
                        busy=(1.0, 1.0), wait=0.9)
    assert advise(none_done).action == UNKNOWN and advise(none_done).workers_needed is None
    nobody = Figures(seconds=60.0, span=60.0, workers=0, demand_tps=500.0, ranks=1, supply_tps=(), busy=(), wait=None)
    assert advise(nobody).action == ADD and advise(nobody).workers_needed == 1


def test_no_advice_before_the_window_is_full():
    early = dataclasses.replace(figures(demand=2970.0, supply=1000.0, busy=0.99, wait=0.31), seconds=20.0)
    assert advise(early).action == UNKNOWN and advise(early).line.startswith("measuring: 20 of the window's 60 s")


def test_a_rank_that_only_waits_asks_a_finite_amount():
    advice = advise(figures(workers=1, demand=1000.0, supply=1000.0, busy=1.0, wait=1.0, ranks=1))
    assert advice.action == ADD and math.isfinite(advice.need or math.inf) and advice.workers_needed == 20


def test_window_covers_its_span_and_percentiles():
    window = Window(span=10.0)
    assert window.increase() == (0.0, ())
    for t in range(0, 31):
        window.add(float(t), (t * 2.0, t * 0.5))
    seconds, (a, b) = window.increase()
    assert seconds == 10.0 and a == 20.0 and b == 5.0
    # A long window of frequent samples keeps a bounded number of them, and still its whole span.
    long = Window(span=600.0)
    for t in range(0, 3000):
        long.add(t * 0.5, (float(t),))
    seconds, (grown,) = long.increase()
    assert 600.0 <= seconds <= 610.0 and grown == pytest.approx(2 * seconds)
    assert len(long._samples) <= 2 * 120 + 2  # of two consecutive gaps between samples, one is a full gap
    assert percentiles([], 0.5) == (None,)
    assert percentiles([3.0, 1.0, 2.0, 4.0], 0.5, 0.95) == (2.0, 4.0)


# ------------------------------------------------------------------ the broker's measure


def beat(router, client: bytes, now: float, service: str = SERVICE, **header) -> None:
    state = router.client_seen(client, now)
    handle(router.client_heartbeat, state, now, CLIENT_TAG, ClientCommand.HEARTBEAT, header=header, service=service)


def reports(router, outcome: str) -> float:
    return router.metrics.client_reports.labels(outcome=outcome)._value.get()


class Clock:
    """The broker's ``time.monotonic`` where a part reads it (dispatch): the test's ``now``."""

    def __init__(self, monkeypatch):
        self.now = time.monotonic()
        fake = types.SimpleNamespace(monotonic=lambda: self.now)
        monkeypatch.setattr("spec_serve.broker.dispatch.time", fake)
        monkeypatch.setattr("spec_serve.broker.routing.time", fake)


@pytest.fixture
def clock(monkeypatch) -> Clock:
    return Clock(monkeypatch)


def run_steps(router, clock: Clock, client: bytes, steps: int, service: str = SERVICE) -> float:
    """``steps`` one-second rounds from ``clock.now``: the client asks for 100 tokens, a worker answers in
    0.5 s, the client reports it waited 0.5 s and computed 0.5 s; the router samples each second."""
    start = now = clock.now
    for i in range(steps):
        clock.now = now
        request_id = submit(router, client, now, service=service, tokens=100)
        clock.now = now + 0.5
        done(router, router.requests[request_id].worker, request_id, now + 0.5, tokens=100)
        now += 1.0
        clock.now = now
        beat(router, client, now, service=service, steps=i + 1, wait_s=0.5 * (i + 1), compute_s=0.5 * (i + 1))
        router.measure(now)
    clock.now = start
    return now


def test_the_broker_measures_demand_supply_wait_and_queueing(clock):
    router = make_router(sizing_window=5.0)
    ready(router, b"w1", clock.now)
    run_steps(router, clock, b"rank0", 8)
    ready(router, b"w2", clock.now + 8)
    entry = router.supply.services[SERVICE]
    assert entry["ranks"] == 1 and entry["demand_tps"] == pytest.approx(100.0, rel=0.05)
    assert entry["trainer_wait"] == pytest.approx(0.5, abs=0.02)
    w1 = router.supply.workers[b"w1"]
    assert w1["busy"] == pytest.approx(0.5, abs=0.05) and w1["supply_tps"] == pytest.approx(200.0, rel=0.1)
    router.measure(clock.now + 9)
    router.measure(clock.now + 10)
    assert router.supply.workers[b"w2"] == {"busy": 0.0, "supply_tps": None}  # never busy: no supply figure
    assert entry["queue_wait_p95_s"] is not None and entry["queue_wait_p95_s"] < 0.5
    # Latency, not capacity: one worker at 200 tokens/s keeps up with 100 / (1 - 0.5) asked
    assert entry["advice"]["action"] == BALANCED and "prefetch_depth" in entry["advice"]["line"]
    # ... and of two workers, one would do
    assert router.supply.services[SERVICE]["advice"]["action"] == REMOVE
    assert reports(router, "accepted") >= 6


def test_absurd_reports_are_clamped_or_ignored_and_counted_and_skew_no_other_service(clock):
    router = make_router(sizing_window=5.0)
    ready(router, b"w1", clock.now)
    ready(router, b"w2", clock.now, service="other")
    run_steps(router, clock, b"liar", 3)
    later = run_steps(router, clock, b"honest", 3, service="other")
    honest = router.supply.services["other"]["trainer_wait"]
    rejected, clamped, reset, foreign = (reports(router, outcome)
                                         for outcome in ("rejected", "clamped", "reset", "foreign_service"))
    for header in ({"wait_s": -5.0, "compute_s": 1.0}, {"wait_s": float("nan"), "compute_s": 1.0},
                   {"wait_s": float("inf"), "compute_s": 0.0}, {"wait_s": "x", "compute_s": 1}, {"steps": -1}):
        beat(router, b"liar", later, **header)
    assert reports(router, "rejected") == rejected + 5
    beat(router, b"liar", later + 1.0, wait_s=1e300, compute_s=1.5)  # more seconds than ever passed
    assert reports(router, "clamped") == clamped + 1
    liar = router.clients[b"liar"]
    assert liar.wait_s + liar.compute_s < 10.0  # at most the seconds that passed, with slack
    beat(router, b"liar", later + 2.0, wait_s=0.0, compute_s=0.0)  # counters went back
    assert reports(router, "reset") == reset + 1
    beat(router, b"liar", later + 3.0, service="other", wait_s=9e9, compute_s=0.0)  # a service it never asked
    assert reports(router, "foreign_service") == foreign + 1
    router.measure(later + 3.0)
    assert router.supply.services["other"]["trainer_wait"] == pytest.approx(honest, abs=0.01)
    assert 0.0 <= router.supply.services[SERVICE]["trainer_wait"] <= 1.0
    assert router.metrics.registry.get_sample_value("spec_serve_trainer_wait_fraction", {"service": "other"}) == \
        pytest.approx(honest, abs=0.01)


def test_a_client_that_leaves_frees_its_worker_busy_time():
    router = make_router(sizing_window=5.0)
    now = time.monotonic()
    ready(router, b"w1", now)
    submit(router, b"gone", now, tokens=10)
    assert router.workers[b"w1"].busy_since is not None
    router.delete_client(b"gone")
    assert router.workers[b"w1"].busy_since is None and router.workers[b"w1"].busy_s >= 0.0


def test_a_request_held_again_after_its_client_was_forgotten_keeps_its_worker_busy(clock):
    """A client the broker forgot while a worker ran its request (only late) sends it again: the request is that
    worker's again (``Dispatcher.reattach``), and so is the time until its DONE: the worker is busy from then on,
    as for any request it holds (that time went uncounted: its busy interval stayed closed)."""
    router = make_router(sizing_window=5.0)
    start = clock.now
    ready(router, b"w1", start)
    request_id = new_request_id()

    def send(now: float) -> None:
        handle(router.enqueue, router.client_seen(b"late", now), now, CLIENT_TAG, ClientCommand.REQUEST, request_id,
               {"reply_to": "tcp://127.0.0.1:9", "timeout": 30.0})

    send(start)
    clock.now = start + 1.0
    router.delete_client(b"late")  # busy 1 s so far
    send(start + 2.0)
    worker = router.workers[b"w1"]
    assert worker.inflight == {request_id} and router.recorder.requests_to(b"w1") == [request_id]  # held, sent once
    assert worker.busy_since == start + 2.0
    done(router, b"w1", request_id, start + 5.0, tokens=10)
    assert worker.busy_s == pytest.approx(1.0 + 3.0) and worker.busy_since is None


def test_status_and_metrics_carry_the_figures(clock):
    from spec_serve.broker.status import full_status

    router = make_router(sizing_window=5.0)
    ready(router, b"w1", clock.now)
    run_steps(router, clock, b"rank0", 8)
    status = full_status(router)
    sizing = status["services"][SERVICE]["sizing"]
    assert set(sizing) >= {"demand_tps", "ranks", "supply_tps", "busy", "trainer_wait", "queue_wait_p50_s",
                           "queue_wait_p95_s", "advice"}
    assert sizing["advice"]["line"] and status["workers"][0]["busy"] is not None
    sample = router.metrics.registry.get_sample_value
    assert sample("spec_serve_workers_needed", {"service": SERVICE}) == sizing["advice"]["workers_needed"]
    assert sample("spec_serve_queue_wait_seconds", {"service": SERVICE, "quantile": "0.95"}) == \
        sizing["queue_wait_p95_s"]
    assert sample("spec_serve_worker_busy_fraction", {"service": SERVICE, "worker": status["workers"][0]["id"]}) == \
        status["workers"][0]["busy"]
    # Before a full window (a service that just started) the advice's count has no sample: a gap, not a zero.
    fresh = make_router(sizing_window=5.0)
    ready(fresh, b"w1", clock.now)
    fresh.measure(clock.now)
    assert fresh.supply.services[SERVICE]["advice"]["workers_needed"] is None
    assert fresh.metrics.registry.get_sample_value("spec_serve_workers_needed", {"service": SERVICE}) is None


# ------------------------------------------------------------------ the rank's meter


def test_the_meter_splits_steps_into_wait_and_compute():
    stats = ClientStats()
    meter = DemandMeter(stats, "svc")
    assert meter.report() == ("svc", None)  # nothing asked yet: nothing reported
    source: concurrent.futures.Future = concurrent.futures.Future()
    meter.step()
    meter.requested(64)
    future = metered(source, meter)
    threading.Timer(0.2, source.set_result, ("batch",)).start()
    assert future.result(timeout=5) == "batch"  # blocked about 0.2 s: the step's wait
    time.sleep(0.1)  # the trainer's compute
    _, mid = meter.report()
    assert mid is not None and mid.compute_s is not None and mid.compute_s >= 0.09  # counted up to now
    meter.step()
    assert stats.steps == 2 and stats.requested_tokens == 64
    assert 0.18 <= stats.wait_s <= 1.0 and 0.09 <= stats.compute_s <= 1.0
    assert 0.0 < (stats.wait_fraction or 0.0) < 1.0
    _, after = meter.report()
    assert after is not None and after.wait_s is not None and mid.wait_s is not None and after.wait_s >= mid.wait_s
    assert future.result() == "batch"  # done: no wait counted again
    assert stats.wait_s == pytest.approx(after.wait_s, abs=1e-5)


def test_the_meter_counts_overlapping_waits_once():
    stats = ClientStats()
    meter = DemandMeter(stats, "svc")
    meter.step()
    source: concurrent.futures.Future = concurrent.futures.Future()
    future = metered(source, meter)
    threads = [threading.Thread(target=future.result) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    source.set_result(1)
    for t in threads:
        t.join()
    assert 0.15 <= stats.wait_s < 0.5  # three threads blocked 0.2 s together: 0.2 s of the rank's time


def test_the_heartbeat_header_round_trips():
    stats = ClientStats()
    meter = DemandMeter(stats, "svc")
    meter.step()
    service, header = meter.report()
    assert service == "svc" and header is not None
    assert ClientHeartbeat.from_json(header.to_json()) == header
