"""Chaos soak: client ranks run against a local cluster while workers are SIGKILLed and restarted.

Every result is checked with torch.equal against the colocated HFTarget. Prints
and writes (JSON) requests sent, completed, verified, retried, lost (must be 0)
and duplicated (must be 0: a duplicate reply reaching the user; duplicates
the client dropped by request id are counted separately as ``dropped_duplicates``).

    python benchmarks/chaos_soak.py --duration 60 --workers 3 --ranks 4 --out soak.json
    python benchmarks/chaos_soak.py --target /models/tiny --duration 3600   # a long soak
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from spec_serve.client.api import RemoteTargetModel
from spec_serve.engines.hf import HFTarget
from spec_serve.supervision.vocab import build_vocab_mapping
from spec_serve.tools.launch import local_cluster
from spec_serve.tools.tiny import make_tiny_target, sample_batch

FAST_ENV = {"SPEC_SERVE_HEARTBEAT_INTERVAL": "0.2", "SPEC_SERVE_HEARTBEAT_LIVENESS": "5",
            "SPEC_SERVE_UNKNOWN_SERVICE_GRACE": "300"}


def soak(target: str, duration: float, workers: int, ranks: int, kill_every: float, seed: int,  # noqa: C901, PLR0915
         distinct: int = 16, log_dir: Path | None = None, max_retries: int = 10, timeout: float = 30.0,
         liveness: int = 5) -> dict:
    """``max_retries``: the clients' own retries; 0 leaves every recovery to the broker's re-dispatch.
    ``timeout``: each request's (the broker drops a request no worker took by then); with retries off it is
    the whole wait, so on a loaded box it must outlast the slowest queueing, or a slow request reads as lost.
    ``liveness``: the heartbeats (0.2 s apart) the broker and workers may miss before a peer is gone. A client
    the broker gives up on loses its mappings and queued requests, which only a client retry recovers: with
    retries off, give a loaded box's late heartbeats room."""
    # The soak is one scenario (cluster, training ranks, a killer thread, the tally): read as one piece.
    rng = random.Random(seed)
    # The references run with the workers' math threads (launch: OMP_NUM_THREADS, 1 unless set): on a CPU
    # another thread count may give other low bits (docs/equality.md).
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    reference = HFTarget(target)
    ids, _, loss = sample_batch(target, batch=8, seq=64, seed=0)
    mapping = build_vocab_mapping(ids, loss, reference.vocab_size, reference.vocab_size // 2,
                                  special_token_ids=(0, 1, 2, 3))
    reference.set_vocab_mapping(*mapping)
    batches = {s: sample_batch(target, 2, 16, seed=10_000 + s) for s in range(distinct)}
    expected = {s: reference.generate_batch(*b) for s, b in batches.items()}
    counts = {"sent": 0, "completed": 0, "verified": 0, "wrong": 0, "failed": 0, "retried": 0,
              "dropped_duplicates": 0, "lost": 0, "duplicated": 0, "worker_kills": 0, "worker_restarts": 0}
    lock = threading.Lock()
    stop = threading.Event()
    errors: list[str] = []

    def add(**kw):
        with lock:
            for k, v in kw.items():
                counts[k] += v

    env = {**FAST_ENV, "SPEC_SERVE_HEARTBEAT_LIVENESS": str(liveness)}
    # A request held by each worker the chaos killed looks to the broker like a request that crashes its workers
    # (--max-request-deaths, broker/poison.py), which it fails instead of sending on. The chaos kills at random,
    # not because of a request, so no request may run out of deaths here: one more than the most kills the
    # chaos thread can make (one each half kill_every at the most). The poison policy has its own tests.
    deaths = int(duration / (0.5 * kill_every)) + 2
    with local_cluster(target, workers=workers, env=env, log_dir=log_dir,
                       broker_args=("--max-request-deaths", str(deaths))) as cluster:
        def rank(r: int):
            with RemoteTargetModel(cluster.frontend, prefetch_depth=4, timeout=timeout, max_retries=max_retries,
                                   heartbeat_interval=0.2, liveness=15) as client:
                client.set_vocab_mapping(*mapping)
                inflight: list = []
                delivered: dict[int, int] = {}
                n = 0

                def settle(item):
                    idx, s, fut = item
                    try:
                        got = fut.result(timeout=300)
                    except Exception as e:
                        add(failed=1)
                        errors.append(f"{type(e).__name__}: {e}")
                        return
                    delivered[idx] = delivered.get(idx, 0) + 1
                    ok = got.keys() == expected[s].keys() and all(torch.equal(got[k], expected[s][k])
                                                                  for k in expected[s])
                    add(completed=1, **({"verified": 1} if ok else {"wrong": 1}))

                while not stop.is_set():
                    s = (r * 5 + n) % distinct
                    inflight.append((n, s, client.generate_batch_async(*batches[s])))
                    add(sent=1)
                    n += 1
                    if len(inflight) >= 4:
                        settle(inflight.pop(0))
                for item in inflight:
                    settle(item)
                add(retried=client.stats.retried, dropped_duplicates=client.stats.duplicates,
                    duplicated=sum(c - 1 for c in delivered.values() if c > 1),
                    lost=n - len(delivered))  # failed futures included

        def chaos():
            while not stop.wait(rng.uniform(0.5, 1.5) * kill_every):
                alive = [p for p in cluster.workers if p.poll() is None]
                if len(alive) > 1:
                    victim = rng.choice(alive)
                    victim.send_signal(signal.SIGKILL)
                    victim.wait()
                    cluster.workers.remove(victim)
                    add(worker_kills=1)
                if len([p for p in cluster.workers if p.poll() is None]) < workers:
                    cluster.start_worker(target)
                    add(worker_restarts=1)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
        monkey = threading.Thread(target=chaos, daemon=True)
        start = time.monotonic()
        for t in threads:
            t.start()
        monkey.start()
        time.sleep(duration)
        stop.set()
        for t in threads:
            t.join(timeout=600)
        elapsed = time.monotonic() - start
        hung = sum(t.is_alive() for t in threads)
        _, metrics = cluster.get("/metrics")
    redispatched = sum(float(line.split()[-1]) for line in metrics.splitlines()
                       if line.startswith("spec_serve_redispatched_total"))
    return {**counts, "hung_ranks": hung, "redispatched": redispatched, "duration_s": round(elapsed, 1),
            "workers": workers, "ranks": ranks, "kill_every_s": kill_every, "seed": seed,
            "max_request_deaths": deaths, "errors": errors[:5]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="model directory; default: build the tiny target in a temp dir")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--kill-every", type=float, default=6.0, help="mean seconds between worker kills")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("chaos_soak.json"))
    p.add_argument("--log-dir", type=Path)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        target = args.target or str(make_tiny_target(Path(tmp) / "tiny"))
        result = soak(target, args.duration, args.workers, args.ranks, args.kill_every, args.seed,
                      log_dir=args.log_dir)
    args.out.write_text(json.dumps(result, indent=2))
    print(" ".join(f"{k}={result[k]}" for k in ("sent", "completed", "verified", "retried", "lost", "duplicated",
                                                  "dropped_duplicates", "worker_kills", "worker_restarts",
                                                  "redispatched", "hung_ranks", "duration_s")))
    ok = (result["lost"] == 0 and result["duplicated"] == 0 and result["wrong"] == 0 and result["hung_ranks"] == 0
          and result["verified"] == result["sent"])
    print("OK" if ok else f"FAILED: {result['errors']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
