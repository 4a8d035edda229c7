"""Prometheus metrics: the broker's and each worker's, in a private registry (one per process), a worker's
including its compiled engine's (``CompileCollector``); the client's, process-local."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# No `*_created` series: a timestamp per counter and histogram that scrapers store as data.
prometheus_client.disable_created_metrics()

# Client side, in prometheus_client's default registry: a trainer exposes it with its own exporter
# (e.g. prometheus_client.start_http_server). check: "digest" (bytes changed between the worker's
# device and ours) or "fingerprint" (a reply or refusal from another target than we set up with).
CLIENT_INTEGRITY_FAILURES = Counter("spec_serve_client_integrity_failures",
                                    "Replies a client discarded: digest mismatch or another target",
                                    ["service", "check"])

# Compact EAGLE-3 (client/compact.py): the draft-vocab lm_head slices a client fetched, once per vocab mapping.
CLIENT_LM_HEAD_SLICES = Counter("spec_serve_client_lm_head_slices",
                                "Draft-vocab lm_head slices a client fetched for compact EAGLE-3 (one per mapping)",
                                ["service"])
CLIENT_LM_HEAD_SLICE_BYTES = Counter("spec_serve_client_lm_head_slice_bytes",
                                     "Bytes of the draft-vocab lm_head slices a client fetched", ["service"])

# A rank's demand (client/demand.py; docs/sizing.md): its wait share is rate(wait) / (rate(wait) + rate(compute)).
CLIENT_WAIT_SECONDS = Counter("spec_serve_client_wait_seconds",
                              "Seconds the trainer was blocked waiting for supervision", ["service"])
CLIENT_COMPUTE_SECONDS = Counter("spec_serve_client_compute_seconds",
                                 "Seconds between the trainer's requests it did not wait (its own compute)",
                                 ["service"])
CLIENT_STEPS = Counter("spec_serve_client_steps", "Batches the trainer asked for", ["service"])
CLIENT_REQUESTED_TOKENS = Counter("spec_serve_client_requested_tokens", "Real tokens of the batches asked for",
                                  ["service"])


class BrokerMetrics:
    """Counters the broker updates from its loop; the HTTP shim renders them."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("spec_serve_requests", "Requests received", ["service"], registry=r)
        self.completed = Counter("spec_serve_completed", "Requests completed by workers", ["service", "status"],
                                 registry=r)
        self.tokens = Counter("spec_serve_tokens", "Supervision tokens delivered", ["service"], registry=r)
        self.reply_bytes = Counter("spec_serve_reply_bytes", "Reply payload bytes sent worker -> client",
                                   ["service"], registry=r)
        self.latency = Histogram(
            "spec_serve_request_latency_seconds", "Enqueue to DONE", ["service"], registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.queue_depth = Gauge("spec_serve_queue_depth", "Requests waiting for a worker", ["service"], registry=r)
        self.inflight = Gauge("spec_serve_inflight", "Requests dispatched and not yet done", registry=r)
        self.workers = Gauge("spec_serve_workers", "Registered workers", ["service"], registry=r)
        self.clients = Gauge("spec_serve_clients", "Connected clients", registry=r)
        self.worker_state = Gauge("spec_serve_worker_inflight", "Requests in flight per worker",
                                  ["worker", "service", "state"], registry=r)
        self.redispatched = Counter("spec_serve_redispatched",
                                    "Requests re-dispatched: their worker died, left, or handed them back unrun",
                                    registry=r)
        self.worker_deaths = Counter("spec_serve_worker_deaths",
                                     "Workers expired by missed heartbeats or gone with a dead engine", registry=r)
        self.killer_requests = Counter("spec_serve_killer_requests",
                                       "Requests failed for being on too many workers as they died", registry=r)
        self.duplicate_requests = Counter("spec_serve_duplicate_requests", "Retries of requests still held",
                                          registry=r)
        self.bad_messages = Counter("spec_serve_bad_messages", "Malformed messages dropped or refused", registry=r)
        self.refused_messages = Counter("spec_serve_refused_messages",
                                        "Messages refused unread at ingress: more frames than their kind has "
                                        "(the sender's connection is cut)", ["socket"], registry=r)
        self.errors = Counter("spec_serve_errors", "Error replies sent by the broker", ["code"], registry=r)
        self.curve_refusals = Counter("spec_serve_curve_refusals",
                                      "Handshakes refused, by the role the peer tried (client: the frontend, "
                                      "worker: the backend) and cause (key: its CURVE key is not admitted; "
                                      "handshake: the two ends' CURVE settings differ)", ["role", "cause"],
                                      registry=r)
        self.refused_workers = Counter("spec_serve_refused_workers",
                                       "Workers refused: their target differs from the service's", ["service"],
                                       registry=r)
        self.client_reports = Counter("spec_serve_client_reports", "Clients' demand reports (heartbeats), by what "
                                      "became of them: accepted, first (a baseline), clamped (more seconds than "
                                      "passed), reset (counters went back), rejected (negative, NaN, not a number), "
                                      "foreign_service (a service its requests never named)", ["outcome"], registry=r)
        self.sizing = SizingCollector()
        r.register(self.sizing)

    def forget_service(self, service: str, statuses: tuple[str, ...]) -> None:
        """Drop a forgotten service's series, so label sets do not grow with every name ever used.
        (prometheus_client before 0.20 raises KeyError for a label set it never saw.)"""
        for metric in (self.requests, self.tokens, self.reply_bytes, self.latency, self.queue_depth, self.workers):
            with contextlib.suppress(KeyError):
                metric.remove(service)
        for status in statuses:
            with contextlib.suppress(KeyError):
                self.completed.remove(service, status)

    def set_worker_states(self, workers: list[dict]) -> None:
        """Replace the per-worker gauge with the current set of workers."""
        self.worker_state.clear()
        for w in workers:
            self.worker_state.labels(worker=w["id"], service=w["service"], state=w["state"]).set(w["inflight"])


# Supply and demand per service (broker/supply.py, docs/sizing.md): (metric, help, key of the service's
# ``sizing`` entry). Read when scraped (``SizingCollector``).
SIZING_SERIES = (
    ("spec_serve_demand_tokens_per_second", "Tokens/s trainers asked for", "demand_tps"),
    ("spec_serve_demand_ranks", "Clients that asked for supervision", "ranks"),
    ("spec_serve_supply_tokens_per_second", "Tokens/s the workers deliver while busy, summed: the service's capacity",
     "supply_tps"),
    ("spec_serve_delivered_tokens_per_second", "Tokens/s the workers delivered", "delivered_tps"),
    ("spec_serve_trainer_wait_fraction", "Share of the trainers' step time spent waiting for supervision",
     "trainer_wait"),
    ("spec_serve_busy_fraction", "Share of the time the workers held a request, their mean", "busy"),
)
# The queue-wait quantiles exported (label values) and the keys of the service's entry they come from.
QUEUE_WAIT_QUANTILES = (("0.5", "queue_wait_p50_s"), ("0.95", "queue_wait_p95_s"))


class SizingCollector(Collector):
    """The broker's supply-and-demand figures as gauges, read when scraped: ``read`` returns the latest
    ``{service: sizing entry}`` and ``[worker entries]`` (set by broker/supply.py; replaced whole each tick, so a
    scrape from the HTTP shim's thread sees one tick's). A figure not measured yet leaves no sample (a gap, not a
    made-up zero); ``spec_serve_workers_needed`` is the advice's count, what an autoscaler should run."""

    def __init__(self) -> None:
        self.read: Callable[[], tuple[Mapping[str, Mapping[str, Any]], Sequence[Mapping[str, Any]]]] = lambda: ({}, [])

    def collect(self) -> Iterator[Metric]:
        services, workers = self.read()
        for name, text, key in SIZING_SERIES:
            yield _gauge(name, text, ["service"], (([s], f[key]) for s, f in services.items()))
        yield _gauge("spec_serve_workers_needed", "Workers the advice names (spec-serve status): what an autoscaler "
                     "should run", ["service"], (([s], f["advice"]["workers_needed"]) for s, f in services.items()))
        yield _gauge("spec_serve_queue_wait_seconds", "Time requests waited for a worker", ["service", "quantile"],
                     (([s, quantile], f[key]) for s, f in services.items() for quantile, key in QUEUE_WAIT_QUANTILES))
        for name, text, key in (("spec_serve_worker_busy_fraction", "Share of the time a worker held a request",
                                 "busy"),
                                ("spec_serve_worker_supply_tokens_per_second", "Tokens/s a worker delivers while busy",
                                 "supply_tps")):
            yield _gauge(name, text, ["worker", "service"], (([w["id"], w["service"]], w[key]) for w in workers))


def _gauge(name: str, text: str, labels: list[str],
           values: Iterator[tuple[list[str], float | None]]) -> GaugeMetricFamily:
    """A gauge family of ``(label values, value)``; a value not measured (None) leaves no sample."""
    family = GaugeMetricFamily(name, text, labels=labels)
    for label_values, value in values:
        if value is not None:
            family.add_metric(label_values, value)
    return family


# A forward's wall time, from a few milliseconds (a tiny request on a GPU) to minutes (a long one on a CPU).
FORWARD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class WorkerMetrics:
    """One worker's figures for its ``/metrics``, in a private registry. The forward histogram is observed
    by the compute thread; everything else is read from the worker when scraped (``read`` returns the
    plain figures: see ``_WorkerCollector``), so serving costs nothing while nobody scrapes."""

    def __init__(self, read: Callable[[], Mapping[str, Any]], compile_report: Callable[[], Any] | None = None) -> None:
        self.registry = r = CollectorRegistry()
        self.forward_seconds = Histogram("spec_serve_worker_forward_seconds",
                                         "Wall time of each forward on the engine (a packed group counts once)",
                                         registry=r, buckets=FORWARD_BUCKETS)
        r.register(_WorkerCollector(read))
        if compile_report is not None:  # the engine's, when it compiled its layers (CompileCollector)
            r.register(CompileCollector(compile_report))


class _WorkerCollector(Collector):
    """The figures a worker keeps, as metric families: ``requests`` {DONE status: n}, ``tokens``,
    ``reply_bytes`` {data plane: bytes}, ``digests`` (tensors digested), ``host_slabs`` and ``host_slab_seconds``
    (frames' host slabs made, and the time it took), ``queue_depth``, ``in_forward``,
    ``device_memory`` {(device, kind): bytes}, ``state`` (serving, draining, ...), ``info`` {label: value}."""

    def __init__(self, read: Callable[[], Mapping[str, Any]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        f = self._read()
        info = GaugeMetricFamily("spec_serve_worker_info", "This worker: its id, service, engine and model",
                                 labels=sorted(f["info"]))
        info.add_metric([str(f["info"][k]) for k in sorted(f["info"])], 1)
        yield info
        requests = CounterMetricFamily("spec_serve_worker_requests", "Requests answered, by DONE status "
                                       "(returned: handed back unrun while draining)", labels=["status"])
        for status, n in sorted(f["requests"].items()):
            requests.add_metric([status], n)
        yield requests
        yield CounterMetricFamily("spec_serve_worker_tokens", "Supervision tokens served", value=f["tokens"])
        plane = CounterMetricFamily("spec_serve_worker_reply_bytes", "Reply payload bytes, by data plane",
                                    labels=["plane"])
        for name, n in sorted(f["reply_bytes"].items()):
            plane.add_metric([name], n)
        yield plane
        yield CounterMetricFamily("spec_serve_worker_digests", "Reply tensors digested on the device (verify)",
                                  value=f["digests"])
        yield CounterMetricFamily("spec_serve_worker_host_slabs", "Host slabs made for replies as frames (pinned on "
                                  "a GPU): flat once the longest rows came by", value=f["host_slabs"])
        yield CounterMetricFamily("spec_serve_worker_host_slab_seconds", "Seconds spent making them, on the compute "
                                  "thread (the next forward waits)", value=f["host_slab_seconds"])
        yield GaugeMetricFamily("spec_serve_worker_queue_depth", "Requests held and not started",
                                value=f["queue_depth"])
        yield GaugeMetricFamily("spec_serve_worker_in_forward", "1 while a forward runs", value=f["in_forward"])
        memory = GaugeMetricFamily("spec_serve_worker_device_memory_bytes", "Memory in use: allocated and "
                                   "reserved by this process's torch, used on the whole GPU, or resident (CPU)",
                                   labels=["device", "kind"])
        for (device, kind), n in sorted(f["device_memory"].items()):
            memory.add_metric([device, kind], n)
        yield memory
        yield worker_state_family(f["state"])


def worker_state_family(current: str) -> GaugeMetricFamily:
    """``spec_serve_worker_state``: 1 for ``current``, 0 for every other state a worker can be in."""
    state = GaugeMetricFamily("spec_serve_worker_state", "1 for the state the worker is in", labels=["state"])
    for name in WORKER_STATES:
        state.add_metric([name], float(name == current))
    return state


class StartupCollector(Collector):
    """A worker process's series from its first second, before its ``Worker`` exists (checking its broker,
    loading, probing): ``spec_serve_worker_start_time_seconds`` always, and ``spec_serve_worker_state`` while
    ``phase()`` names the state (None once the worker's own collector reports it), so an alert on a worker
    stuck before it registers can fire."""

    def __init__(self, phase: Callable[[], str | None], started: float) -> None:
        self._phase = phase
        self._started = started

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("spec_serve_worker_start_time_seconds", "When this worker process started "
                                "(Unix time)", value=self._started)
        phase = self._phase()
        if phase is not None:
            yield worker_state_family(phase)


# What a worker's /health reports; only "serving" answers 200.
WORKER_STATES = ("starting", "checking_broker", "loading", "probing", "disconnected", "serving", "draining",
                 "stopping", "engine_dead")


class CompileCollector(Collector):
    """A compiled engine's figures (``engines.compiled.CompileReport``, read when scraped, so they cost nothing
    between scrapes): register it in the registry a worker's ``/metrics`` renders, with ``read`` returning its
    engine's ``compile_report`` (None for an engine without ``compile``: nothing is exported)."""

    def __init__(self, read: Callable[[], Any]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        report = self._read()
        if report is None:
            return
        yield GaugeMetricFamily("spec_serve_worker_compiled", "1 while compiled decoder layers serve, 0 once a "
                                "failed compile put them back to eager", value=float(report.active))
        seconds = CounterMetricFamily("spec_serve_worker_compile_seconds", "Seconds spent compiling decoder layers: "
                                      "at load (every batch class), and in forwards that met a new class",
                                      labels=["phase"])
        seconds.add_metric(["load"], report.seconds)
        seconds.add_metric(["recompile"], report.recompile_seconds)
        yield seconds
        yield CounterMetricFamily("spec_serve_worker_compile_graphs", "Graphs compiled at load",
                                  value=report.graphs)
        yield CounterMetricFamily("spec_serve_worker_compile_classes_loaded", "Batch classes loaded whole at load "
                                  "(compiled and saved by an earlier load: nothing traced)", value=report.loaded)
        yield CounterMetricFamily("spec_serve_worker_compile_recompiles", "Forwards after load that compiled graphs",
                                  value=report.recompiles)
        cache = CounterMetricFamily("spec_serve_worker_compile_cache_lookups", "Inductor FX graph cache lookups at "
                                    "load (hits: kernels loaded, not compiled)", labels=["result"])
        cache.add_metric(["hit"], report.cache_hits)
        cache.add_metric(["miss"], report.cache_misses)
        yield cache
        yield CounterMetricFamily("spec_serve_worker_compile_fallbacks", "Compiles that failed (the engine serves "
                                  "eager; the log says why)", value=float(report.reason is not None))
