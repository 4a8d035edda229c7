"""Several hosts: broker, two workers and a client in separate network namespaces joined by veth
links to a bridge; cut one worker's link mid-run, nothing is lost; restore it, the worker rejoins. And
the netns bench (benchmarks/bench_netns.py: full against compact="auto" over a tc-limited link), for
correctness only.

Needs root and ``ip netns`` (iproute2); skipped with the reason otherwise. Only
private namespaces created here (10.231.0.0/24, bridged in their own hub
namespace) are touched, and they are always removed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from cluster_util import FAST_ENV, HERE

pytestmark = pytest.mark.netns

SUBNET = "10.231.0"
NODES = {"b": 1, "w0": 2, "w1": 3, "c": 4}  # broker, workers, client -> host part of the address


def _netns_unavailable() -> str | None:
    return _bench_netns().unavailable(tools=("ip",))


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def net():
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    tag = f"ss{os.getpid() % 100000}"
    hub = f"{tag}hub"
    names = {node: f"{tag}{node}" for node in NODES}
    created = []
    try:
        _ip("netns", "add", hub)
        created.append(hub)
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        for node, host in NODES.items():
            ns = names[node]
            _ip("netns", "add", ns)
            created.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "add", f"h{node}", "netns", hub, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", ns, "addr", "add", f"{SUBNET}.{host}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", hub, "link", "set", f"h{node}", "master", "br0")
            _ip("-n", hub, "link", "set", f"h{node}", "up")
        yield {"hub": hub, **names}
    finally:
        for ns in reversed(created):
            # Processes still inside would keep the namespace alive: kill only those (they are ours).
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


CLIENT = textwrap.dedent("""
    import json, sys, time, threading
    import torch
    from spec_serve.client.api import RemoteTargetModel
    from spec_serve.engines.hf import HFTarget
    from spec_serve.tools.tiny import sample_batch
    from spec_serve.supervision.vocab import build_vocab_mapping

    frontend, target = sys.argv[1], sys.argv[2]
    say = lambda **kw: print(json.dumps(kw), flush=True)
    ref = HFTarget(target)
    ids, _, loss = sample_batch(target, batch=8, seq=64, seed=0)
    mapping = build_vocab_mapping(ids, loss, 512, 256, special_token_ids=(0, 1, 2, 3))
    ref.set_vocab_mapping(*mapping)
    client = RemoteTargetModel(frontend, prefetch_depth=8, timeout=30, max_retries=5, compact=False,
                               heartbeat_interval=0.2, liveness=15)
    nworkers = lambda: len(client.status()["workers"])
    while nworkers() < 2:
        time.sleep(0.2)
    client.set_vocab_mapping(*mapping)
    say(phase="ready")
    def run(seeds):
        futs = [(s, client.generate_batch_async(*sample_batch(target, 2, 16, seed=s))) for s in seeds]
        say(phase="submitted", n=len(futs))
        ok = wrong = failed = 0
        for s, f in futs:
            try:
                got = f.result()
            except Exception as e:
                failed += 1
                continue
            want = ref.generate_batch(*sample_batch(target, 2, 16, seed=s))
            if all(torch.equal(got[k], want[k]) for k in want) and got.keys() == want.keys():
                ok += 1
            else:
                wrong += 1
        return {"sent": len(futs), "verified": ok, "wrong": wrong, "failed": failed}
    counts = run(range(500, 524))
    say(phase="done", counts=counts, workers=nworkers(), retried=client.stats.retried,
        duplicates=client.stats.duplicates)
    sys.stdin.readline()  # the parent restores the link
    t0 = time.monotonic()
    while nworkers() < 2:
        time.sleep(0.1)
    rejoin = time.monotonic() - t0
    counts2 = run(range(600, 612))
    say(phase="rejoined", rejoin_s=round(rejoin, 2), counts=counts2, duplicates=client.stats.duplicates)
    client.close()
""")


def _spawn(ns: str, args: list[str], log, **kw) -> subprocess.Popen:
    env = {**os.environ, **FAST_ENV}
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, *args], env=env, stdout=log,
                            stderr=subprocess.STDOUT if log is not subprocess.PIPE else None, **kw)


def _expect(proc, phase: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"client exited (rc={proc.poll()}) before phase {phase!r}")
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            continue  # library chatter
        if msg.get("phase") == phase:
            return msg
    raise TimeoutError(phase)


def test_cut_worker_link_loses_nothing_and_worker_rejoins(net, tiny_target_dir, tmp_path):
    broker_url = f"tcp://{SUBNET}.{NODES['b']}"
    logs = {name: open(tmp_path / f"{name}.log", "wb") for name in ("broker", "w0", "w1")}
    procs = []
    try:
        # No CURVE between namespaces: protected mode needs the explicit flag.
        procs.append(_spawn(net["b"], ["-m", "spec_serve.tools.cli", "broker", "--frontend", "tcp://*:5555",
                                       "--backend", "tcp://*:5556", "--http-port", "0", "--insecure-network"],
                            logs["broker"]))
        # w0 is slow (1.5 s a forward) so it certainly holds requests when its link is cut.
        procs.append(_spawn(net["w0"], [str(HERE / "cluster_util.py"), "slow-worker", "--delay", "1.5",
                                        "--target", str(tiny_target_dir), "--broker", f"{broker_url}:5556"],
                            logs["w0"]))
        procs.append(_spawn(net["w1"], ["-m", "spec_serve.tools.cli", "worker", "--target", str(tiny_target_dir),
                                        "--broker", f"{broker_url}:5556"], logs["w1"]))
        client = _spawn(net["c"], ["-c", CLIENT, f"{broker_url}:5555", str(tiny_target_dir)], subprocess.PIPE,
                        stdin=subprocess.PIPE, text=True)
        procs.append(client)
        _expect(client, "ready", 180)
        _expect(client, "submitted", 30)
        time.sleep(1.0)  # w0 now holds requests
        _ip("-n", net["hub"], "link", "set", "hw0", "down")
        cut_at = time.monotonic()
        done = _expect(client, "done", 240)
        print(f"\nnetns: link of w0 cut; {done['counts']} in {time.monotonic() - cut_at:.1f}s after the cut, "
              f"workers seen by the broker {done['workers']}, retried={done['retried']} "
              f"duplicates_dropped={done['duplicates']}")
        assert done["counts"]["verified"] == done["counts"]["sent"] == 24, done
        _ip("-n", net["hub"], "link", "set", "hw0", "up")
        client.stdin.write("restored\n")
        client.stdin.flush()
        rejoined = _expect(client, "rejoined", 120)
        print(f"netns: link restored; w0 rejoined after {rejoined['rejoin_s']}s; {rejoined['counts']} "
              f"duplicates_dropped={rejoined['duplicates']}")
        assert rejoined["counts"]["verified"] == rejoined["counts"]["sent"] == 12, rejoined
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        for f in logs.values():
            f.close()


def _bench_netns():
    spec = importlib.util.spec_from_file_location("bench_netns", HERE.parent / "benchmarks" / "bench_netns.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_netns_bench_full_auto_and_fp8_across_a_rate_limited_link(tmp_path):
    """benchmarks/bench_netns.py, for correctness only (its figures are recorded in BENCHMARKS.md): across
    a veth pair limited by tc, full, compact="auto" and auto with wire_dtype="fp8" replies of the 8B shape
    arrive verified, and default clients on the other side get compact replies (one lm_head slice), FP8 ones
    when asked, restored and expanded bit-equal to the reference."""
    bench = _bench_netns()
    reason = bench.unavailable()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "netns.json"
    proc = subprocess.run([sys.executable, str(HERE.parent / "benchmarks" / "bench_netns.py"), "--rates", "10",
                           "--rounds", "1", "--messages", "2", "--seq", "16", "--rows", "1", "--modes",
                           "full,auto,auto_fp8", "--lengths", "lognormal,full", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["auto_check"] == {
        "compact_replies": 1, "lm_head_slices": 1, "plane_replies": 0, "fp8_replies": 0, "equal": True,
        "fp8": {"compact_replies": 1, "lm_head_slices": 1, "plane_replies": 0, "fp8_replies": 1, "equal": True}}
    assert 0 < report["rates"]["10"]["raw_tcp_gbit_per_s"] < 10.5  # the link's ceiling: tc holds it to 10 Gbit/s
    shapes = report["rates"]["10"]["lengths"]
    assert sorted(shapes) == ["full", "lognormal"]  # real lengths beside full rows, in one run
    for rate in shapes.values():
        assert [f["verified"] for f in rate["full"] + rate["auto"] + rate["auto_fp8"]] == ["2/2", "2/2", "2/2"]
        assert all(f["retried"] == 0 for f in rate["full"] + rate["auto"] + rate["auto_fp8"])
    rate = shapes["full"]
    for figure in rate["full"] + rate["auto"] + rate["auto_fp8"]:  # the steady state: from the first reply landed
        assert figure["padded_tokens"] == 16 and 0 < figure["fill_s"] < figure["window_s"]
        assert figure["seconds"] == pytest.approx(figure["window_s"] - figure["fill_s"], abs=1e-3)
    assert rate["auto"][0]["bytes"] * 4 < rate["full"][0]["bytes"]  # 32 KiB against 149 KiB a token
    # 20 KiB against 32 KiB: the aux hidden states halve, the final state stays bf16 (contract.FP8_TENSORS)
    assert 1.55 < rate["auto"][0]["bytes"] / rate["auto_fp8"][0]["bytes"] < 1.65


def test_a_clients_requests_stay_on_its_hosts_worker_while_it_has_a_slot(tmp_path):
    """Locality (benchmarks/bench_locality.py): two emulated hosts, a worker on each, a client on host A.
    One request at a time, every reply comes from A's worker through the same-host plane (before the
    ranking's locality rule, half of them went to B's worker, the longer idle); with more in flight than A's
    capacity, B's worker takes what would queue behind A's, as frames. Every reply verified."""
    reason = _bench_netns().unavailable(tools=("ip",))
    if reason:
        pytest.skip(reason)
    out = tmp_path / "locality.json"
    proc = subprocess.run([sys.executable, str(HERE.parent / "benchmarks" / "bench_locality.py"), "--messages", "6",
                           "--seq", "8", "--prefetch", "6", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"], report
    assert report["sequential"] == {"replies": 6, "plane": 6, "plane_share": 1.0, "verified": "6/6"}
    assert 0 < report["burst"]["plane"] < 6 and report["burst"]["verified"] == "6/6"
