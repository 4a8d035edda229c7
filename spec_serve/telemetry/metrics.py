"""Prometheus metrics: the broker's, in a private registry (one per broker); the client's, process-local."""

from __future__ import annotations

import contextlib

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# No `*_created` series: a timestamp per counter and histogram that scrapers store as data.
prometheus_client.disable_created_metrics()

# Client side, in prometheus_client's default registry: a trainer exposes it with its own exporter
# (e.g. prometheus_client.start_http_server). check: "digest" (bytes changed between the worker's
# device and ours) or "fingerprint" (a reply or refusal from another target than we set up with).
CLIENT_INTEGRITY_FAILURES = Counter("spec_serve_client_integrity_failures",
                                    "Replies a client discarded: digest mismatch or another target",
                                    ["service", "check"])


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
        self.errors = Counter("spec_serve_errors", "Error replies sent by the broker", ["code"], registry=r)
        self.refused_workers = Counter("spec_serve_refused_workers",
                                       "Workers refused: their target differs from the service's", ["service"],
                                       registry=r)

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
