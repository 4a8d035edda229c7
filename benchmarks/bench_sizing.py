"""Supply and demand on a GPU (issue 38): one worker, 1 to N ranks with an emulated trainer step, the
trainers' wait share and the broker's advice as the ranks grow (docs/sizing.md).

    python benchmarks/bench_sizing.py --gpu-8b --device cuda:0 --json sizing.json   # Llama-3.1-8B shape, 1 GPU
    python benchmarks/bench_sizing.py --device cpu --window 4 --phase-s 8 --batch 2 --seq 64   # tiny, CPU

One broker and one worker (the 8B shape with random bf16 weights, as ``bench_e2e.py --gpu-8b``). First a
rank with no compute measures how long a request holds the worker (``request_s``); the emulated trainer step
is then ``--compute-factor`` x that (a sleep: the trainer's own GPU work is not what is measured here). Then
1, 2, ... ``--max-ranks`` ranks (threads, a client each, ``prefetch_depth`` 2) run side by side, one more per
phase; at the end of each phase (``--phase-s``, longer than the broker's ``--window``) the broker's figures
for the service are read from its HTTP shim, with each rank's own wait share from ``client.stats`` over the
phase. Every reply is compared with ``torch.equal`` to the colocated forward of the same batch (the worker
runs each request alone, so the same composition); the JSON says how many were and whether all matched.

With factor 1.2 one rank asks 1 / 1.2 of what the worker delivers (balanced), two ranks 1.7 workers' worth,
three 2.5: the advice should go from balanced to add 1 to add 2 (or more, with the transport's share), and the
trainers' wait from near 0 up.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from spec_serve.client.api import RemoteTargetModel  # noqa: E402
from spec_serve.engines.hf import HFTarget  # noqa: E402
from spec_serve.supervision.vocab import build_vocab_mapping  # noqa: E402
from spec_serve.tools.bench import LLAMA_8B_AUX_LAYERS, LLAMA_8B_CONFIG, padded_batch, worker_threads  # noqa: E402
from spec_serve.tools.launch import Cluster  # noqa: E402
from spec_serve.tools.random_target import write_random_init_target  # noqa: E402
from spec_serve.tools.tiny import make_tiny_target  # noqa: E402
from spec_serve.tools.verify import colocated_reference, mismatch  # noqa: E402

SERVICE = "sizing"
DISTINCT_BATCHES = 4  # replies are checked against these batches' colocated forwards, kept on the device


class Rank(threading.Thread):
    """A trainer: asks for the next batch, waits for the one before, checks it, computes ``compute_s``."""

    def __init__(self, frontend: str, device: str, mapping, batches, references, compute_s: float):
        super().__init__(daemon=True)
        self.client = RemoteTargetModel(frontend, service=SERVICE, device=device, prefetch_depth=2, timeout=300)
        self.client.set_vocab_mapping(*mapping)
        self.batches, self.references, self.compute_s = batches, references, compute_s
        self.halt = threading.Event()
        self.verified = self.mismatched = 0
        self.first_mismatch: str | None = None
        self.error: str | None = None

    def run(self) -> None:
        try:
            step = 0
            pending = (step, self.client.generate_batch_async(*self.batches[step % DISTINCT_BATCHES]))
            while not self.halt.is_set():
                step += 1
                following = (step, self.client.generate_batch_async(*self.batches[step % DISTINCT_BATCHES]))
                self._check(*pending)
                time.sleep(self.compute_s)
                pending = following
            self._check(*pending)
        except Exception as e:  # reported in the JSON
            self.error = f"{type(e).__name__}: {e}"

    def _check(self, step: int, future) -> None:
        wrong = mismatch(future.result(), self.references[step % DISTINCT_BATCHES])
        if wrong is None:
            self.verified += 1
        else:
            self.mismatched += 1
            self.first_mismatch = self.first_mismatch or wrong

    def counters(self) -> tuple[float, float]:
        stats = self.client.stats
        return stats.wait_s, stats.compute_s

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=300)
        self.client.close()


def calibrate(frontend: str, device: str, mapping, batches, references, rounds: int = 6) -> float:
    """Seconds one request holds the worker, end to end, with nothing else asking (after 2 warm-up rounds)."""
    with RemoteTargetModel(frontend, service=SERVICE, device=device, timeout=300) as client:
        client.set_vocab_mapping(*mapping)
        times = []
        for i in range(rounds):
            started = time.perf_counter()
            got = client.generate_batch(*batches[i % DISTINCT_BATCHES])
            times.append(time.perf_counter() - started)
            assert mismatch(got, references[i % DISTINCT_BATCHES]) is None, "calibration reply differs"
    return sorted(times[2:])[len(times[2:]) // 2]


def sizing(cluster: Cluster) -> dict[str, Any]:
    _, body = cluster.get("/workers")
    return body["services"].get(SERVICE, {}).get("sizing") or {}


def _target(args: argparse.Namespace) -> tuple[Path, list[str], str | None, list[int] | None]:
    """The target directory, the worker's flags for it, and the colocated engine's dtype and aux layers."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-sizing-"))
    if args.target:
        return Path(args.target), [], None, None
    if args.gpu_8b:
        return (write_random_init_target(tmp / "llama-8b-shape", LLAMA_8B_CONFIG),
                ["--dtype", "bfloat16", "--aux-layer-ids", LLAMA_8B_AUX_LAYERS], "bfloat16",
                [int(i) for i in LLAMA_8B_AUX_LAYERS.split(",")])
    return make_tiny_target(tmp / "tiny"), [], None, None


def _references(target: Path, device: str, dtype: str | None, aux: list[int] | None, batches, mapping) -> list:
    """The colocated forward of each batch, on ``device`` (the engine itself is let go)."""
    with worker_threads(torch.device(device)):
        engine = HFTarget(target, device=device, dtype=dtype, aux_layer_ids=aux)
        engine.set_vocab_mapping(*mapping)
        references = [colocated_reference(engine, b, "eagle3", device=device, selected=mapping) for b in batches]
    del engine
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # the colocated weights go back; the references stay
    return references


def run(args: argparse.Namespace) -> dict[str, Any]:
    target, extra, dtype, aux = _target(args)
    vocab = int(json.loads((target / "config.json").read_text())["vocab_size"])
    batches = [padded_batch([args.seq] * args.batch, vocab, seed=s) for s in range(DISTINCT_BATCHES)]
    ids, loss = torch.cat([b[0].reshape(-1) for b in batches]), torch.cat([b[2].reshape(-1) for b in batches])
    mapping = build_vocab_mapping(ids, loss, vocab, min(args.draft_vocab, vocab))
    cluster = Cluster.on_free_ports(env={"SPEC_SERVE_SIZING_WINDOW": str(args.window),
                                         "SPEC_SERVE_UNKNOWN_SERVICE_GRACE": "600"},
                                    log_dir=Path(args.log_dir) if args.log_dir else None)
    ranks: list[Rank] = []
    try:
        cluster.start_broker()
        cluster.start_worker(target, "--device", args.device, "--capacity", "2", *extra, service=SERVICE)
        started = time.perf_counter()
        references = _references(target, args.device, dtype, aux, batches, mapping)  # while the worker loads
        cluster.wait_workers(1, timeout=900)
        print(f"[sizing] worker ready, references built in {time.perf_counter() - started:.0f}s", flush=True)
        request_s = calibrate(cluster.frontend, args.device, mapping, batches, references)
        compute_s = args.compute_factor * request_s
        print(f"[sizing] a request holds the worker {request_s:.3f}s; trainer step {compute_s:.3f}s", flush=True)
        phases = [_grow(cluster, ranks, args, Rank(cluster.frontend, args.device, mapping, batches, references,
                                                  compute_s)) for _ in range(args.max_ranks)]
    finally:
        for rank in ranks:
            rank.stop()
        cluster.stop()
    verified, mismatched = sum(r.verified for r in ranks), sum(r.mismatched for r in ranks)
    errors = [r.error for r in ranks if r.error] + [r.first_mismatch for r in ranks if r.first_mismatch]
    return {"benchmark": "sizing", "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else
            "cpu", "target": "llama-3.1-8b-shape" if args.gpu_8b else "tiny", "batch": args.batch, "seq": args.seq,
            "window_s": args.window, "phase_s": args.phase_s, "request_s": round(request_s, 4),
            "compute_s": round(compute_s, 4), "compute_factor": args.compute_factor, "phases": phases,
            "verified": verified, "mismatched": mismatched, "errors": errors,
            "ok": mismatched == 0 and not errors and verified > 0}


def _grow(cluster: Cluster, ranks: list[Rank], args: argparse.Namespace, rank: Rank) -> dict[str, Any]:
    """One more rank; after ``--phase-s`` seconds, the broker's figures and each rank's wait over the phase."""
    ranks.append(rank)
    rank.start()
    before = [r.counters() for r in ranks]
    time.sleep(args.phase_s)
    after = [r.counters() for r in ranks]
    phase = _phase(len(ranks), sizing(cluster), before, after)
    print(f"[sizing] {len(ranks)} rank(s): trainers wait {_pct(phase['trainer_wait'])} (broker), "
          f"{', '.join(_pct(w) for w in phase['rank_wait'])} (ranks); workers busy {_pct(phase['busy'])}; "
          f"advice: {phase['advice'].get('line')}", flush=True)
    return phase


def _phase(ranks: int, figures: dict[str, Any], before: list, after: list) -> dict[str, Any]:
    """The broker's figures at the end of a phase, with each rank's wait share over the phase."""
    waits = []
    for (w0, c0), (w1, c1) in zip(before, after):
        step = (w1 - w0) + (c1 - c0)
        waits.append(round((w1 - w0) / step, 4) if step > 0 else None)
    keys = ("trainer_wait", "busy", "demand_tps", "supply_tps", "delivered_tps", "queue_wait_p50_s",
            "queue_wait_p95_s", "window_s")
    return {"ranks": ranks, **{k: figures.get(k) for k in keys}, "rank_wait": waits,
            "advice": figures.get("advice") or {}}


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{share:.0%}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu-8b", action="store_true", help="The Llama-3.1-8B shape, random bf16 weights.")
    p.add_argument("--target", default=None, help="A model directory (default: the tiny target, or with --gpu-8b "
                   "the 8B shape).")
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--max-ranks", type=int, default=3)
    p.add_argument("--compute-factor", type=float, default=1.2,
                   help="The emulated trainer step, in units of one request's time on the worker.")
    p.add_argument("--window", type=float, default=15.0, help="The broker's --sizing-window (seconds).")
    p.add_argument("--phase-s", type=float, default=25.0, help="Seconds each rank count runs before it is read.")
    p.add_argument("--json", default=None, help="Write the figures here.")
    p.add_argument("--log-dir", default=None, help="Broker and worker logs.")
    args = p.parse_args(argv)
    if args.phase_s <= args.window:
        p.error("--phase-s must exceed --window: each phase's figures must cover that phase only")
    report = run(args)
    text = json.dumps(report, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
