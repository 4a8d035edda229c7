"""Supply and demand with real processes: a broker, test-only slow workers (each forward takes a set time)
and ranks (threads with a client each) whose trainer step is a set compute time. The advice follows the
measured numbers' direction: too few workers -> add; one added -> the trainers' wait falls and the advice
changes; a rank gone, workers idle -> fewer would do. ``spec-serve status`` prints it on the running cluster.

The figures (tests/broker/test_sizing.py has the rule): each forward holds a worker FORWARD_S, a rank computes
COMPUTE_S between batches and prefetches 2. Two ranks need 2 x FORWARD_S / COMPUTE_S = 1.33 workers, more with
the tiny model's own forward and the transport (0.05-0.1 s a request on a loaded 2-core box): one worker is
short (need > 1.05), two are enough (need < 2.1, and ceil(need x 1.1) = 2 keeps both) while that overhead
stays under 0.2 s. One rank needs 0.67 (0.83 with 0.1 s overhead): one worker of two would do.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from cluster_util import CLIENT_KW, FAST_ENV, start_slow_worker, wait_until
from spec_serve.client.api import RemoteTargetModel
from spec_serve.tools.cli import main
from spec_serve.tools.launch import local_cluster
from spec_serve.tools.tiny import sample_batch

ROOT = Path(__file__).resolve().parents[2]
SERVICE = "sizing"
FORWARD_S = 0.4
COMPUTE_S = 0.6
WINDOW_S = 4.0
PHASE_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def cluster(tiny_target_dir, tmp_path_factory):
    env = dict(FAST_ENV, SPEC_SERVE_SIZING_WINDOW=str(WINDOW_S))
    with local_cluster(tiny_target_dir, workers=0, env=env, log_dir=tmp_path_factory.mktemp("sizing-logs")) as c:
        start_slow_worker(c, tiny_target_dir, FORWARD_S, "--capacity", "1", "--service", SERVICE)
        c.wait_workers(1, service=SERVICE)
        yield c


class Rank(threading.Thread):
    """A trainer: asks for a batch, waits for the one before it, computes COMPUTE_S; prefetch 2."""

    def __init__(self, cluster, target_dir, mapping):
        super().__init__(daemon=True)
        self.client = RemoteTargetModel(cluster.frontend, service=SERVICE, prefetch_depth=2, timeout=60.0,
                                        **CLIENT_KW)
        self.client.set_vocab_mapping(*mapping)
        self.batch = sample_batch(target_dir, 2, 16, seed=1)
        self.halt = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            pending = self.client.generate_batch_async(*self.batch)
            while not self.halt.is_set():
                following = self.client.generate_batch_async(*self.batch)
                pending.result()
                time.sleep(COMPUTE_S)
                pending = following
            pending.result()
        except BaseException as e:  # the test reports it
            self.error = e

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=60)
        self.client.close()
        assert self.error is None, self.error


def sizing(cluster) -> dict:
    _, body = cluster.get("/workers")
    return body["services"].get(SERVICE, {}).get("sizing") or {}


def advised(cluster, action: str, also=lambda s: True) -> dict:
    """The service's figures once its advice is ``action`` (and ``also`` holds), waited for."""
    def ready():
        s = sizing(cluster)
        return s if s.get("ranks") and s["advice"]["action"] == action and also(s) else None
    return wait_until(ready, PHASE_TIMEOUT_S, interval=0.2, what=f"advice {action!r}")


def test_advice_follows_supply_and_demand(cluster, tiny_target_dir, tiny_vocab_mapping):
    ranks = [Rank(cluster, tiny_target_dir, tiny_vocab_mapping) for _ in range(2)]
    for rank in ranks:
        rank.start()
    try:
        short = advised(cluster, "add", lambda s: s["ranks"] == 2 and s["trainer_wait"] is not None)
        print("one worker:", short)
        assert short["busy"] > 0.6 and short["trainer_wait"] > 0.05 and short["advice"]["workers_needed"] >= 2

        out = CliRunner().invoke(main, ["status", "--broker", cluster.frontend])
        print(out.output)
        assert out.exit_code == 0, out.output
        assert "advice: add " in out.output and "trainers wait" in out.output, out.output

        start_slow_worker(cluster, tiny_target_dir, FORWARD_S, "--capacity", "1", "--service", SERVICE)
        cluster.wait_workers(2, service=SERVICE)
        enough = advised(cluster, "balanced", lambda s: s["trainer_wait"] < short["trainer_wait"] / 2)
        print("two workers:", enough)
        assert enough["supply_tps"] > short["supply_tps"]  # two workers' capacity

        ranks.pop().stop()
        idle = advised(cluster, "remove", lambda s: s["ranks"] == 1)
        print("one rank:", idle)
        assert idle["advice"]["workers_needed"] == 1 and idle["busy"] < enough["busy"]
        stats = ranks[0].client.stats
        assert stats.steps > 0 and stats.wait_s > 0 and stats.compute_s > stats.wait_s
        _, metrics = cluster.get("/metrics")
        for series in ("workers_needed", "trainer_wait_fraction", "demand_tokens_per_second",
                       "supply_tokens_per_second"):
            assert f'spec_serve_{series}{{service="{SERVICE}"}}' in metrics
    finally:
        for rank in ranks:
            rank.stop()


def test_the_gpu_sizing_bench_runs_here(tiny_target_dir, tmp_path, capsys):
    """benchmarks/bench_sizing.py (the GPU figure: BENCHMARKS.md, "Supply and demand") end to end on the tiny
    target, short phases: every reply equal to the colocated forward, a figure and an advice per rank count."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_sizing", ROOT / "benchmarks" / "bench_sizing.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "sizing.json"
    with pytest.raises(SystemExit) as exited:
        bench.main(["--target", str(tiny_target_dir), "--device", "cpu", "--batch", "2", "--seq", "32",
                    "--window", "1", "--phase-s", "2", "--max-ranks", "2", "--json", str(out)])
    assert exited.value.code == 0, capsys.readouterr().out[-2000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["verified"] > 0 and [p["ranks"] for p in report["phases"]] == [1, 2]
    assert all(p["advice"].get("line") for p in report["phases"])


def test_absurd_reports_over_the_wire_are_counted_and_the_broker_serves_on(cluster):
    """A peer on the clients' port sends heartbeats with absurd demand figures (NaN, negative, huge, for a
    service it never asked): the broker counts them, stays healthy and keeps serving STATUS."""
    import zmq

    from spec_serve.protocol.commands import CLIENT_TAG, ClientCommand, control

    def reports(outcome: str) -> float:
        _, text = cluster.get("/metrics")
        line = f'spec_serve_client_reports_total{{outcome="{outcome}"}}'
        found = [float(row.split()[-1]) for row in text.splitlines() if row.startswith(line)]
        return found[0] if found else 0.0

    rejected, foreign = reports("rejected"), reports("foreign_service")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(cluster.frontend)
    try:
        for header in ({"wait_s": float("nan"), "compute_s": 1.0}, {"wait_s": -1.0, "compute_s": 1.0},
                       {"steps": "many"}):
            sock.send_multipart(control(CLIENT_TAG, ClientCommand.HEARTBEAT.value, SERVICE, header=header))
        sock.send_multipart(control(CLIENT_TAG, ClientCommand.HEARTBEAT.value, SERVICE,
                                    header={"wait_s": 1e300, "compute_s": 0.0}))
        wait_until(lambda: reports("rejected") >= rejected + 3 and reports("foreign_service") >= foreign + 1, 30,
                   what="the absurd reports counted")
    finally:
        sock.close(0)
    assert cluster.get("/health")[0] == 200
    out = CliRunner().invoke(main, ["status", "--broker", cluster.frontend, "--json"])
    assert out.exit_code == 0 and json.loads(out.output)["services"][SERVICE]["workers"] >= 1, out.output
