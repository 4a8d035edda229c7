"""Locality (issue 36, item 3): two emulated hosts, a worker on each, and a client on host A. How many of its
replies take the same-host plane, that is, were served by A's worker.

Host A and host B are network namespaces joined by a veth pair. Host A runs one driver process that starts the
broker and A's null worker (spec_serve/tools/null_engine.py, capacity 2, 8B-shaped replies) as its children, so
the client and A's worker share a host key (an `ip netns exec` of their own would give each its own mount
namespace: another "host"); host B runs B's null worker. Two loads, each reply checked against what the null
engine answers (verified=N/N):

  sequential  one request at a time: A's worker always has a free slot, so every reply should take the plane
  burst       PREFETCH requests in flight, more than A's capacity: B's worker takes those that would queue
              behind A's, as frames (each forward lasts --forward-ms, so a burst does queue: with instant
              forwards A may finish each request before the next arrives, and rightly keeps them all)

and per load the share of replies that took the plane (stats.plane_replies over replies). The broker ranks
a request that is `near` host A (the plane's offer) onto A's worker while it has a free slot
(spec_serve/broker/ranking.py); before that rule it took the least-loaded worker, ties to the longest idle,
which alternates between the two hosts when requests come one at a time.

Needs root and iproute2 (`ip netns`); exits 2 naming what is missing otherwise. Creates only its own
namespaces (bench_netns's two, 10.232.0.0/24) and removes them, with every process it started in them.

  python benchmarks/bench_locality.py --json locality.json
  python benchmarks/bench_locality.py --messages 6 --seq 8      # what the test suite runs
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_netns import WORKER_ADDR, Link, unavailable  # noqa: E402

HOST_A = WORKER_ADDR
# argv: the broker's backend, the emulated forward's seconds.
NULL_WORKER = ("import sys; from spec_serve.tools.null_engine import run_worker; "
               "run_worker(sys.argv[1], 'null', float(sys.argv[2]))")


def run(messages: int, seq: int, prefetch: int, forward_s: float, timeout: float = 300) -> dict:
    """Both loads on two emulated hosts (bench_netns's ``Link``: host A is its worker side, host B the
    other); the driver's report (see the module's docstring)."""
    with Link() as link:
        link.spawn(link.client_ns, ["-c", NULL_WORKER, f"tcp://{HOST_A}:5556", str(forward_s)],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        driver = link.spawn(link.worker_ns, [__file__, "_host_a", *map(str, (messages, seq, prefetch, forward_s))],
                            stdout=subprocess.PIPE, text=True)
        out, _ = driver.communicate(timeout=timeout)
        if driver.returncode != 0:
            raise RuntimeError(f"the driver on host A exited with {driver.returncode}")
        return json.loads(out.strip().splitlines()[-1])


def _host_a(messages: int, seq: int, prefetch: int, forward_s: float) -> dict:
    """Inside host A: the broker and A's worker as children (one mount namespace with the client), then the
    client's two loads."""
    from spec_serve.client.api import RemoteTargetModel
    from spec_serve.tools.bench import make_batch
    from spec_serve.tools.null_engine import VOCAB, null_mapping, null_tensors
    from spec_serve.tools.verify import mismatch

    children = [subprocess.Popen([sys.executable, "-m", "spec_serve.tools.cli", "broker", "--frontend", "tcp://*:5555",
                                  "--backend", "tcp://*:5556", "--http-port", "0", "--insecure-network"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
                subprocess.Popen([sys.executable, "-c", NULL_WORKER, f"tcp://{HOST_A}:5556", str(forward_s)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    report: dict = {"config": {"messages": messages, "seq": seq, "prefetch": prefetch, "forward_s": forward_s}}
    try:
        with RemoteTargetModel(f"tcp://{HOST_A}:5555", service="null", prefetch_depth=prefetch, timeout=120,
                               compact=False, connect_timeout=60) as client:
            deadline = time.monotonic() + 120
            while len(client.status("null")["workers"]) < 2:
                if time.monotonic() > deadline:
                    raise TimeoutError("both workers did not register within 120 s")
                time.sleep(0.2)
            client.set_vocab_mapping(*null_mapping())
            batch, want = make_batch(1, seq, VOCAB, 0), null_tensors(1, seq, "eagle3")
            for load in ("sequential", "burst"):
                before = client.stats.plane_replies
                if load == "sequential":
                    results = [client.generate_batch(*batch, kind="eagle3") for _ in range(messages)]
                else:
                    futures = [client.generate_batch_async(*batch, kind="eagle3") for _ in range(messages)]
                    results = [f.result() for f in futures]
                plane = client.stats.plane_replies - before
                verified = sum(mismatch(got, want) is None for got in results)
                report[load] = {"replies": messages, "plane": plane, "plane_share": round(plane / messages, 3),
                                "verified": f"{verified}/{messages}"}
    finally:
        for child in children:
            child.terminate()
            child.wait(10)
    return report


def ok(report: dict) -> bool:
    """Every reply verified, every sequential one by the plane, and the burst spread over both hosts."""
    verified = all(report[load]["verified"] == f"{report[load]['replies']}/{report[load]['replies']}"
                   for load in ("sequential", "burst"))
    return verified and report["sequential"]["plane_share"] == 1.0 and 0 < report["burst"]["plane_share"] < 1.0


def main(argv: list[str]) -> int:
    if argv and argv[0] == "_host_a":
        print(json.dumps(_host_a(int(argv[1]), int(argv[2]), int(argv[3]), float(argv[4]))), flush=True)
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--messages", type=int, default=32, help="replies per load [32]")
    p.add_argument("--seq", type=int, default=64, help="tokens per reply (1 x SEQ) [64]")
    p.add_argument("--prefetch", type=int, default=6, help="requests in flight in the burst [6]")
    p.add_argument("--forward-ms", type=float, default=100.0,
                   help="each worker's emulated forward: long beside a submission, so a burst must queue [100]")
    p.add_argument("--json", default=None, help="write the report here")
    a = p.parse_args(argv)
    reason = unavailable(tools=("ip",))
    if reason:
        print(f"bench_locality: {reason}", file=sys.stderr)
        return 2
    report = run(a.messages, a.seq, a.prefetch, a.forward_ms / 1e3)
    report["ok"] = ok(report)
    for load in ("sequential", "burst"):
        got = report[load]
        print(f"{load:>10}: {got['plane']}/{got['replies']} replies by the plane (share {got['plane_share']}), "
              f"verified {got['verified']}")
    print("OK" if report["ok"] else "NOT OK")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
