"""Operating spec-serve under an orchestrator and Prometheus (issue 23 item 3): a worker's own HTTP port
(/health for probes, /metrics per worker) with real processes, and the alerting rules and Grafana
dashboard in examples/, whose every PromQL expression must name metrics and labels the code registers."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from cluster_util import (
    CLIENT_KW,
    FAST_ENV,
    Reference,
    assert_equal_batches,
    hold_plane_copies,
    kill,
    listening_addresses,
    wait_until,
)
from spec_serve.client.api import RemoteTargetModel
from spec_serve.supervision.contract import RESPONSE_TENSORS, Kind
from spec_serve.telemetry.metrics import (
    CLIENT_COMPUTE_SECONDS,
    CLIENT_INTEGRITY_FAILURES,
    CLIENT_WAIT_SECONDS,
    WORKER_STATES,
    BrokerMetrics,
    WorkerMetrics,
)
from spec_serve.tools.launch import Cluster, free_port

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ALERTS = EXAMPLES / "prometheus" / "alerts.yml"
DASHBOARD = EXAMPLES / "grafana" / "spec-serve.json"

# ------------------------------------------------------------------ the worker's HTTP port


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _health(base: str) -> tuple[int, str | None]:
    try:
        code, body = _get(base + "/health")
    except OSError:
        return 0, None
    return code, json.loads(body).get("state")


def _samples(base: str) -> dict[tuple[str, tuple], float]:
    """The worker's /metrics as {(sample name, sorted labels): value}."""
    code, text = _get(base + "/metrics")
    assert code == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _check_figures(figures: dict[tuple[str, tuple], float], tokens: int) -> None:
    """What a worker that served two same-host DSpark requests shows."""
    assert figures[("spec_serve_worker_requests_total", (("status", "ok"),))] == 2
    assert figures[("spec_serve_worker_tokens_total", ())] == tokens
    assert figures[("spec_serve_worker_reply_bytes_total", (("plane", "shm"),))] > 0
    assert figures[("spec_serve_worker_reply_bytes_total", (("plane", "nccl"),))] == 0
    assert figures[("spec_serve_worker_forward_seconds_count", ())] == 2  # the load-time probe is not served
    assert figures[("spec_serve_worker_digests_total", ())] == 2 * len(RESPONSE_TENSORS[Kind.DSPARK])  # verify=all
    assert figures[("spec_serve_worker_host_slabs_total", ())] == 0  # replies through the plane: no host slab
    assert figures[("spec_serve_worker_queue_depth", ())] == 0
    assert figures[("spec_serve_worker_device_memory_bytes", (("device", "cpu"), ("kind", "resident")))] > 0
    assert figures[("spec_serve_worker_state", (("state", "serving"),))] == 1
    assert figures[("spec_serve_worker_state", (("state", "draining"),))] == 0


def test_worker_http_port_reports_health_and_metrics(tiny_target_dir, tiny_vocab_mapping, tmp_path, monkeypatch):
    """A worker started before its broker (--wait-for-broker) answers /health 503 (checking_broker) on
    127.0.0.1 only; 200 once registered; 503 while its broker is gone (disconnected) and 200 when it is
    back; 503 while it drains after SIGTERM. /metrics counts what it served: requests, tokens, bytes per
    data plane, forward seconds, digests, queue depth, memory."""
    reference = Reference(tiny_target_dir, tiny_vocab_mapping)
    cluster = Cluster.on_free_ports(env=FAST_ENV, log_dir=tmp_path)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    try:
        proc = cluster.start_worker(tiny_target_dir, "--http-port", str(port), "--wait-for-broker", "120")
        wait_until(lambda: _health(base) == (503, "checking_broker"), 60, what="503 while it waits for a broker")
        assert listening_addresses(proc.pid) == {"0100007F"}, "the HTTP port binds loopback only"
        assert _get(base + "/nowhere")[0] == 404
        stuck = _samples(base)  # before it ever registers: its state and start time, from the first second
        assert stuck[("spec_serve_worker_state", (("state", "checking_broker"),))] == 1
        assert sum(v for (name, _), v in stuck.items() if name == "spec_serve_worker_state") == 1
        assert 0 < time.time() - stuck[("spec_serve_worker_start_time_seconds", ())] < 120
        assert _alert_matches("SpecServeWorkerNotServing", stuck)
        cluster.start_broker()
        wait_until(lambda: _health(base) == (200, "serving"), 120, what="200 once registered")
        with RemoteTargetModel(cluster.frontend, timeout=60, **CLIENT_KW) as client:
            for seed in (1, 2):
                got = client.generate_batch(*reference.batch(seed), kind="dspark")
                assert_equal_batches(got, reference.expected(seed, kind="dspark"))
            assert client.stats.plane_replies == 2
        # The worker counts a reply once ZeroMQ took it, so its client may hold it a moment before: wait for both.
        served = ("spec_serve_worker_requests_total", (("status", "ok"),))
        wait_until(lambda: _samples(base).get(served) == 2, 30, what="the worker counting both replies")
        _check_figures(_samples(base), tokens=sum(int(reference.batch(seed)[1].sum()) for seed in (1, 2)))

        kill(cluster.broker)
        wait_until(lambda: _health(base) == (503, "disconnected"), 30, what="503 without its broker")
        cluster.start_broker()
        wait_until(lambda: _health(base) == (200, "serving"), 60, what="200 with a broker again")

        copying, go_on = hold_plane_copies(monkeypatch)
        with RemoteTargetModel(cluster.frontend, timeout=60, heartbeat_interval=CLIENT_KW["heartbeat_interval"],
                               liveness=100) as client:
            future = client.generate_batch_async(*reference.batch(3), kind="dspark")
            assert copying.wait(60)
            proc.send_signal(signal.SIGTERM)
            wait_until(lambda: _health(base) == (503, "draining"), 30, what="503 while it drains")
            go_on.set()
            assert_equal_batches(future.result(timeout=60), reference.expected(3, kind="dspark"))
        assert proc.wait(30) == 0
    finally:
        cluster.stop()


# --------------------------------------------------------- alerting rules and the dashboard

# Series Prometheus makes itself for every target, and the labels it adds to each sample.
PROMETHEUS_SERIES = {"up": set()}
TARGET_LABELS = {"job", "instance"}
# PromQL functions, aggregations and keywords that look like identifiers.
PROMQL_WORDS = {
    "rate", "irate", "increase", "delta", "idelta", "deriv", "sum", "min", "max", "avg", "count", "stddev",
    "topk", "bottomk", "quantile", "histogram_quantile", "absent", "absent_over_time", "clamp_min", "clamp_max",
    "max_over_time", "min_over_time", "avg_over_time", "sum_over_time", "time", "vector", "scalar", "label_replace",
    "and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left", "group_right",
}
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\[[^\]]*\]|[A-Za-z_:][A-Za-z0-9_:]*|\d+(?:\.\d+)?(?:e[+-]?\d+)?|\S')


def registered_series() -> dict[str, set[str]]:
    """Every series name the code can expose (broker, worker, client) and the labels each carries."""
    series: dict[str, set[str]] = {}
    instruments = [m for m in vars(BrokerMetrics()).values() if isinstance(m, MetricWrapperBase)]
    for metric in [*instruments, CLIENT_INTEGRITY_FAILURES, CLIENT_WAIT_SECONDS, CLIENT_COMPUTE_SECONDS]:
        name, labels, kind = metric._name, set(metric._labelnames), metric._type
        suffixes = {"counter": ["_total"], "gauge": [""], "histogram": ["_bucket", "_sum", "_count"]}[kind]
        for suffix in suffixes:
            series[name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    sizing = BrokerMetrics().sizing  # the broker's supply-and-demand gauges, read when scraped
    entry = {"demand_tps": 1.0, "ranks": 1, "supply_tps": 1.0, "delivered_tps": 1.0, "trainer_wait": 0.1, "busy": 0.5,
             "queue_wait_p50_s": 0.1, "queue_wait_p95_s": 0.2, "advice": {"workers_needed": 1}}
    sizing.read = lambda: ({"s": entry}, [{"id": "w", "service": "s", "busy": 0.5, "supply_tps": 1.0}])
    for family in sizing.collect():
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    figures = {"info": {"worker": "w", "service": "s", "engine": "hf", "model": "m"}, "requests": {"ok": 1},
               "tokens": 1, "reply_bytes": {"frames": 1}, "digests": 1, "host_slabs": 1, "host_slab_seconds": 0.1,
               "queue_depth": 0, "in_forward": 0, "device_memory": {("cpu", "resident"): 1}, "state": "serving"}
    worker = WorkerMetrics(lambda: figures)
    worker.forward_seconds.observe(0.1)
    for family in worker.registry.collect():
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


def parse_promql(expr: str) -> tuple[list[tuple[str, set[str]]], set[str]]:
    """The metric selectors of a PromQL expression (name, label names matched) and the label names its
    grouping clauses (by, without, on, ...) use."""
    tokens = _TOKEN.findall(expr)
    selectors: list[tuple[str, set[str]]] = []
    grouped: set[str] = set()
    i = 0
    while i < len(tokens):
        token = tokens[i]
        following = tokens[i + 1] if i + 1 < len(tokens) else ""
        if token in GROUPING and following == "(":
            end = tokens.index(")", i)
            grouped.update(t for t in tokens[i + 2:end] if t != ",")
            i = end + 1
            continue
        if re.fullmatch(r"[A-Za-z_:][A-Za-z0-9_:]*", token) and token not in PROMQL_WORDS and following != "(":
            labels: set[str] = set()
            if following == "{":
                end = tokens.index("}", i)
                matchers = "".join('""' if t.startswith('"') else t for t in tokens[i + 2:end])
                labels = set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)(?:=~|!~|!=|=)", matchers))
                i = end
            selectors.append((token, labels))
        elif re.fullmatch(r"[A-Za-z_]+", token) and following == "(":
            assert token in PROMQL_WORDS, f"unknown PromQL function {token!r} in {expr!r}"
        i += 1
    return selectors, grouped


def _check_expression(expr: str, series: dict[str, set[str]], where: str) -> list[str]:
    """What ``expr`` names that the code does not register (empty: all good)."""
    known = {**series, **PROMETHEUS_SERIES}
    selectors, grouped = parse_promql(expr)
    problems = [f"{where}: no metric {name!r}" for name, _ in selectors if name not in known]
    available = set(TARGET_LABELS)
    for name, labels in selectors:
        have = known.get(name, set()) | TARGET_LABELS
        available |= have
        problems += [f"{where}: {name} has no label {label!r}" for label in labels - have]
    problems += [f"{where}: no metric of it has label {label!r}" for label in grouped - available]
    if not selectors:
        problems.append(f"{where}: names no metric: {expr!r}")
    return problems


def _alert_matches(alert: str, samples: dict[tuple[str, tuple], float]) -> bool:
    """Whether ``alert``'s expression, of the form ``NAME{LABEL=~"A|B"} == N``, holds for some sample."""
    (expr,) = [e for where, e in _alert_expressions() if where == f"alert {alert}"]
    m = re.fullmatch(r'(\w+)\{(\w+)=~"([^"]*)"\}\s*==\s*([\d.]+)', expr.strip())
    assert m, f"alert {alert}: {expr!r} is not NAME{{LABEL=~\"RE\"}} == N"
    name, label, pattern, value = m.groups()
    return any(n == name and re.fullmatch(pattern, dict(labels).get(label, "")) and v == float(value)
               for (n, labels), v in samples.items())


def _alert_expressions() -> list[tuple[str, str]]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [(f"alert {rule['alert']}", rule["expr"]) for group in rules["groups"] for rule in group["rules"]]


def _dashboard_expressions() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            out.append((f"panel {panel['title']!r} {target['refId']}", target["expr"]))
    return out


def test_the_promql_parser_finds_names_and_labels():
    selectors, grouped = parse_promql(
        'histogram_quantile(0.99, sum by (service, le) (rate(spec_serve_x_bucket{a="1",b=~"x|y"}[5m]))) > 2 '
        'and on (service) spec_serve_y == 0')
    assert selectors == [("spec_serve_x_bucket", {"a", "b"}), ("spec_serve_y", set())]
    assert grouped == {"service", "le"}
    series = {"spec_serve_y": {"service"}}
    assert _check_expression("rate(spec_serve_nope_total[5m])", series, "t") == ["t: no metric 'spec_serve_nope_total'"]
    assert _check_expression('spec_serve_y{servce="a"}', series, "t") == ["t: spec_serve_y has no label 'servce'"]
    assert _check_expression("sum by (worker) (spec_serve_y)", series, "t") == [
        "t: no metric of it has label 'worker'"]


def test_alerts_and_dashboard_name_only_registered_metrics():
    """Every expression of examples/prometheus/alerts.yml and examples/grafana/spec-serve.json names metrics
    and labels that the broker, the workers or the clients register; the alerts cover what an operator must
    hear about; every worker state a worker reports is one the dashboard can show."""
    series = registered_series()
    expressions = _alert_expressions() + _dashboard_expressions()
    problems = [p for where, expr in expressions for p in _check_expression(expr, series, where)]
    assert problems == []
    alerts = " ".join(expr for where, expr in _alert_expressions())
    for needed in ("spec_serve_workers", "spec_serve_client_integrity_failures_total", "spec_serve_redispatched_total",
                   "spec_serve_worker_state", "spec_serve_trainer_wait_fraction", "spec_serve_workers_needed"):
        assert needed in alerts, f"no alert on {needed}"
    assert set(WORKER_STATES) >= {"serving", "draining", "disconnected", "engine_dead"}


def test_the_dashboard_loads_as_grafana_json():
    """Grafana's import needs a JSON object with panels, each with a type, a title, a grid position and
    (for graphs) Prometheus targets on the dashboard's datasource variable; ids unique."""
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    graphs = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(graphs) >= 12
    for panel in graphs:
        assert panel["title"] and set(panel["gridPos"]) == {"h", "w", "x", "y"}, panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
        assert all(t["expr"] and t["datasource"]["uid"] == "${datasource}" for t in panel["targets"]), panel["title"]
    # Supply and demand (docs/sizing.md): the panel and the alert an operator sizes the pool with.
    (supply,) = [p for p in graphs if p["title"] == "Supply vs demand"]
    exprs = " ".join(t["expr"] for t in supply["targets"])
    assert "spec_serve_demand_tokens_per_second" in exprs and "spec_serve_supply_tokens_per_second" in exprs
    starved = [expr for where, expr in _alert_expressions() if where == "alert SpecServeTrainersStarved"]
    assert starved and "spec_serve_trainer_wait_fraction" in starved[0] and "spec_serve_workers_needed" in starved[0]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Prometheus) is not installed here")
def test_promtool_accepts_the_rules_and_the_config():
    out = subprocess.run(["promtool", "check", "config", str(EXAMPLES / "prometheus" / "prometheus.yml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr
