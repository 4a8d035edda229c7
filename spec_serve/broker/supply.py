"""Supply and demand per service, measured: what trainers ask and wait, what workers deliver and how busy they
are, how long requests queue; and, once a tick, each service's figures and advice (sizing.py's rule).

Demand is counted from the REQUESTs the broker admits (the tokens they name) and the clients' heartbeats
(``ClientHeartbeat``: how long a rank waited and computed); supply from the workers' DONEs and the time each
held a request. Every figure is over the last ``span`` seconds (``--sizing-window``). What a client reports is
trusted only as far as it can be true: for a service its own requests named, never decreasing, never more
seconds than passed; anything else is clamped or ignored and counted (``spec_serve_client_reports``).
"""

from __future__ import annotations

from typing import Any

from spec_serve.broker.context import BrokerContext
from spec_serve.broker.sizing import Figures, Window, advise, percentiles
from spec_serve.broker.state import ClientState, Request, ServiceState, WorkerState
from spec_serve.protocol.messages import ClientHeartbeat

# The seconds a report may cover beyond the time that passed between two of them, and that time's factor:
# heartbeats leave and arrive with some jitter (the client counts up to the moment it sends).
REPORT_SLACK_S = 1.0
REPORT_SLACK = 1.5
# A worker busy for less of the window than this many seconds has no supply figure (too few tokens to tell).
MIN_BUSY_S = 0.05


class SupplyDemand:
    """The broker's measure of supply and demand; single-threaded (the broker loop calls it)."""

    def __init__(self, ctx: BrokerContext, span: float):
        self.ctx = ctx
        self.span = span
        # Latest figures (sample): per service its entry for status, per worker (identity) its own. Replaced
        # whole each tick: the metrics, read from the HTTP shim's thread, see one tick's figures.
        self.services: dict[str, dict[str, Any]] = {}
        self.workers: dict[bytes, dict[str, Any]] = {}
        self._labelled: list[dict[str, Any]] = []  # the workers' figures with their id and service, for metrics
        ctx.metrics.sizing.read = lambda: (self.services, self._labelled)

    # ------------------------------------------------------------------ events

    def asked(self, service: ServiceState, client: bytes, tokens: int, now: float) -> None:
        """A generate REQUEST was admitted: ``tokens`` more asked of ``service`` by ``client``."""
        service.asked += tokens
        service.askers[client] = now

    def dispatched(self, service: ServiceState, request: Request, now: float) -> None:
        """``request`` left the queue for a worker: how long it waited there."""
        service.queue_waits.append((now, max(0.0, now - request.enqueued_at)))

    def reported(self, client: ClientState, service: str, beat: ClientHeartbeat, now: float) -> None:
        """A client's HEARTBEAT with its counters: accepted as far as they can be true (see the module doc)."""
        if beat.wait_s is None or beat.compute_s is None:
            return  # an older client, or one that has not asked yet: nothing reported
        if service not in client.services:
            return self._count("foreign_service")
        last, client.last_report = client.last_report, (now, float(beat.wait_s), float(beat.compute_s))
        if last is None or client.report_service != service:
            client.report_service = service
            return self._count("first")  # a baseline: what it counted before is not this window's
        waited, computed = beat.wait_s - last[1], beat.compute_s - last[2]
        if waited < 0 or computed < 0:
            return self._count("reset")  # counters went back: from here on, this report is the baseline
        most = (now - last[0]) * REPORT_SLACK + REPORT_SLACK_S
        if waited + computed > most:
            scale = most / (waited + computed)
            waited, computed = waited * scale, computed * scale
            self._count("clamped")
        else:
            self._count("accepted")
        client.wait_s += waited
        client.compute_s += computed

    def rejected(self) -> None:
        """A client's HEARTBEAT header that does not check out (negative, NaN, not a number): ignored."""
        self._count("rejected")

    def _count(self, outcome: str) -> None:
        self.ctx.metrics.client_reports.labels(outcome=outcome).inc()

    # ------------------------------------------------------------------ once a tick

    def sample(self, services: dict[str, ServiceState], workers: dict[bytes, WorkerState],
               clients: dict[bytes, ClientState], now: float) -> None:
        """Add this tick's samples to every window, then compute each service's figures and advice."""
        reporting: dict[str, list[ClientState]] = {}
        for client in clients.values():
            if client.report_service is not None:
                _window(client, self.span).add(now, (client.wait_s, client.compute_s))
                reporting.setdefault(client.report_service, []).append(client)
        self.workers = {w.identity: self._worker_figures(w, now) for w in workers.values()}
        entries = {}
        for name, service in services.items():
            _window(service, self.span).add(now, (service.asked,))
            for asker in [c for c, t in service.askers.items() if t < now - self.span]:
                del service.askers[asker]
            while service.queue_waits and service.queue_waits[0][0] < now - self.span:
                service.queue_waits.popleft()
            mine = [workers[i] for i in service.workers if i in workers and not workers[i].leaving]
            entries[name] = self._service_entry(service, mine, reporting.get(name, []))
        self.services = entries
        self._labelled = [dict(self.workers[w.identity], id=w.name, service=w.service) for w in workers.values()]

    def _worker_figures(self, worker: WorkerState, now: float) -> dict[str, Any]:
        window = _window(worker, self.span)
        window.add(now, (worker.tokens, worker.busy_until(now)))
        seconds, grown = window.increase()
        if not seconds:
            return {"busy": None, "supply_tps": None}
        tokens, busy = grown
        supply = tokens / busy if busy >= MIN_BUSY_S else None
        return {"busy": round(min(1.0, busy / seconds), 4), "supply_tps": None if supply is None else round(supply, 1)}

    def _service_entry(self, service: ServiceState, workers: list[WorkerState],
                       reporting: list[ClientState]) -> dict[str, Any]:
        seconds, grown = _window(service, self.span).increase()
        demand = grown[0] / seconds if seconds else 0.0
        waited = computed = 0.0
        for client in reporting:
            _, counted = _window(client, self.span).increase()
            if counted:
                waited, computed = waited + counted[0], computed + counted[1]
        wait = waited / (waited + computed) if waited + computed > 0 else None
        figures = [self.workers[w.identity] for w in workers]
        measured = Figures(seconds=seconds, span=self.span, workers=len(workers), demand_tps=demand,
                           ranks=len(service.askers), supply_tps=tuple(f["supply_tps"] for f in figures),
                           busy=tuple(f["busy"] or 0.0 for f in figures), wait=wait)
        advice = advise(measured)
        p50, p95 = percentiles([w for _, w in service.queue_waits], 0.5, 0.95)
        return {"window_s": round(seconds, 1), "demand_tps": round(demand, 1), "ranks": measured.ranks,
                "supply_tps": round(sum(s for s in measured.supply_tps if s is not None), 1),
                "delivered_tps": round(sum((f["supply_tps"] or 0.0) * (f["busy"] or 0.0) for f in figures), 1),
                "busy": round(measured.mean_busy, 4), "trainer_wait": None if wait is None else round(wait, 4),
                "queue_wait_p50_s": _rounded(p50), "queue_wait_p95_s": _rounded(p95),
                "advice": advice.to_json()}


def _window(record: WorkerState | ClientState | ServiceState, span: float) -> Window:
    if record.window is None:
        record.window = Window(span)
    return record.window


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 4)
