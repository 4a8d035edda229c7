"""Where a frames reply's way back goes, stage by stage, on one clock across the client and worker processes.

A broker, one worker and one client on loopback, the same-host plane off (frames). The worker serves a stand-in
engine: no model, ready reply tensors of the Llama-3.1-8B shape on its device (``null_engine.INFO``) after an
emulated forward of ``--forward-ms`` (a GPU: bf16 matmuls on the worker's stream, so its device->host copy and
digest wait for them as for a real forward; the CPU: a sleep, which frees the GIL as a GPU forward mostly does).
With ``--gpu-8b`` it serves the real forward of the 8B shape (random weights) instead.
Everything else is the product's own path: the worker's pinned host slabs, side copy stream and I/O loop, the
client's I/O thread, landing (staging slabs on a GPU), digest check and (``compact``) expansion. Each request is
stamped with ``time.monotonic`` (CLOCK_MONOTONIC: one clock for every process of the host) at each stage:

  c_submit     the trainer thread builds the request (its prefetch credit taken)
  c_sent       the client's I/O thread sends it to the broker
  w_recv       the worker's I/O thread takes it from the broker
  w_fwd_start  the compute thread starts it (before: queued behind the forward in progress)
  w_served     the forward, the digest (a sync on the forward) and the queueing of the device->host copy are done
  w_collected  the I/O thread took the result from the compute thread
  w_handed     ... handed it to ZeroMQ (after its copy completed) and told the broker DONE
  c_arrived    the client's I/O thread has the whole reply (libzmq hands over whole messages only)
  c_landed     its tensors are on the client's device
  c_checked    the digest check passed (then a compact reply is expanded on the expander thread)
  c_resolved   the batch's future resolved (its credit goes back: the next request may be sent)
  w_left       libzmq let go of the reply's last frame (the worker's slab goes back)

Per mode, reply size and prefetch depth it prints the batch period and the median of each stage, and at prefetch 1
(nothing else in flight) a least-squares fit of each stage over the reply sizes: a fixed part (ms) and a part per
MB. A delay that does not depend on bytes shows as a fixed part. Every reply's digest is checked by the client
(``verify="all"``). JSON goes to ``--out``.

    python benchmarks/profile_way_back.py                                     # CPU: compact-wire, dspark
    python benchmarks/profile_way_back.py --device cuda:0 --forward-ms 185 --modes compact,dspark --out $OUT
    python benchmarks/profile_way_back.py --device cuda:0 --gpu-8b --modes compact,dspark --out $OUT/8b
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

clock = time.monotonic
ROWS = 4
STAGES = ("c_submit", "c_sent", "w_recv", "w_fwd_start", "w_served", "w_collected", "w_handed", "c_arrived",
          "c_landed", "c_checked", "c_resolved")
# mode -> (the client's compact option, the kind asked, the kind on the wire)
MODES = {"compact": (True, "eagle3", "eagle3_compact"),  # compact on the wire, expanded by the client
         "compact-wire": (False, "eagle3_compact", "eagle3_compact"),  # compact, not expanded (a CPU can't)
         "dspark": (False, "dspark", "dspark")}


# ------------------------------------------------------------------ the worker process

def _stand_in(device: torch.device, forward_ms: float):
    """A stand-in engine: the 8B reply shape of each kind, ready on ``device``, after ``forward_ms`` of work."""
    from spec_serve.supervision.contract import Kind, reply_specs
    from spec_serve.tools import null_engine

    class StandIn(null_engine.NullEngine):
        def __init__(self) -> None:
            super().__init__()
            self.device = device
            self._cache: dict[tuple, dict[str, torch.Tensor]] = {}  # per shape and kind: ready on the device
            self._a = torch.ones(4096, 4096, dtype=torch.bfloat16, device=device) if device.type == "cuda" else None
            self._matmuls = self._calibrate() if self._a is not None else 0

        def _calibrate(self) -> int:
            """Matmuls in ``forward_ms`` on this GPU."""
            for _ in range(3):
                self._a @ self._a
            torch.cuda.synchronize(device)
            start, n = time.perf_counter(), 50
            for _ in range(n):
                self._a @ self._a
            torch.cuda.synchronize(device)
            return max(1, round(forward_ms / 1e3 / ((time.perf_counter() - start) / n)))

        def generate_batch(self, input_ids, attention_mask, loss_mask, kind="eagle3"):
            if self._a is None:
                time.sleep(forward_ms / 1e3)
            else:
                for _ in range(self._matmuls):
                    self._a @ self._a
            key = (*input_ids.shape, kind)
            if key not in self._cache:
                specs = reply_specs(Kind.parse(kind), null_engine.INFO, *input_ids.shape, loss_mask.dtype,
                                    null_engine.DRAFT_VOCAB)
                self._cache[key] = {name: torch.ones(shape, dtype=dtype, device=device)
                                    for name, (dtype, shape) in specs.items()}
            return self._cache[key]

    return StandIn()


def _engine(device: torch.device, forward_ms: float, target: str):
    """The stand-in, or (``target``) the real forward of that target (``--gpu-8b``)."""
    if not target:
        return _stand_in(device, forward_ms)
    from spec_serve.engines.hf import HFTarget
    from spec_serve.tools.bench import LLAMA_8B_AUX_LAYERS

    aux = [int(i) for i in LLAMA_8B_AUX_LAYERS.split(",")]
    return HFTarget(target, device=device, dtype="bfloat16", aux_layer_ids=aux)


def _worker(backend: str, device: str, forward_ms: float, stamps: str, target: str) -> None:
    """A worker of the stand-in engine (or ``target``), each request's stages written to ``stamps`` (JSON lines)."""
    import signal

    from spec_serve.paths.frames import worker as frames_worker
    from spec_serve.worker import executor, replies, server

    out = open(stamps, "w", buffering=1)

    def stamp(request_id: bytes, stage: str) -> None:
        out.write(json.dumps({"rid": request_id.hex(), "stage": stage, "t": clock()}) + "\n")

    def wrap(owner, name, before=None, after=None, key=lambda *a: None):
        original = getattr(owner, name)

        def wrapped(*args):
            rid = key(*args)
            if before:
                stamp(rid, before)
            result = original(*args)
            if after:
                stamp(rid, after)
            return result
        setattr(owner, name, wrapped)

    wrap(executor.Executor, "serve", "w_fwd_start", "w_served", key=lambda self, job: job.request_id)
    wrap(replies.Outbox, "add", "w_collected", key=lambda self, result, now: result.job.request_id)
    original_hand_off = replies.Outbox._hand_off

    def hand_off(self, reply_socket, result, now):
        if result.out.loan is not None:
            result.out.loan.request_id = result.job.request_id  # for w_left
        sent = original_hand_off(self, reply_socket, result, now)
        if sent is not None:
            stamp(result.job.request_id, "w_handed")
        return sent

    replies.Outbox._hand_off = hand_off
    wrap(frames_worker.SlabShare, "left", after="w_left", key=lambda self: self.request_id)
    worker = server.Worker(_engine(torch.device(device), forward_ms, target), backend, service="standin", capacity=2,
                           host_pool=True)
    original_request = worker.session.handlers[server.WorkerCommand.REQUEST]

    def on_request(msg):
        stamp(msg.request_id, "w_recv")
        original_request(msg)

    worker.session.handlers[server.WorkerCommand.REQUEST] = on_request
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    worker.run()


# ------------------------------------------------------------------ the client

class ClientStamps:
    """Stamps the client's stages of each request (by request id) while installed."""

    def __init__(self) -> None:
        from spec_serve.client import assembly, io_thread, pending, worker_replies
        from spec_serve.protocol.commands import parse_data

        self.stages: dict[str, dict[str, float]] = collections.defaultdict(dict)
        self.last = ""
        stages = self.stages
        new_id, add = io_thread.new_request_id, pending.Requests.add
        on_data, init, land, finish = (worker_replies.WorkerReplies.on_data, assembly._Batch.__init__,
                                       assembly._Batch._land, assembly._Batch._finish)

        def new_request_id():
            rid = new_id()
            self.last = rid.hex()
            stages[self.last]["c_submit"] = clock()
            return rid

        def requests_add(requests, p, now):
            stages[p.request_id.hex()].setdefault("c_sent", clock())
            add(requests, p, now)

        def data(replies, frames):
            stages[parse_data(frames)[1].hex()].setdefault("c_arrived", clock())
            on_data(replies, frames)

        def batch_init(batch, *args):
            init(batch, *args)
            batch.rid = self.last  # made right after its one shard was submitted

        def batch_land(batch, *args):
            landed = land(batch, *args)
            stages[batch.rid]["c_landed"] = clock()
            return landed

        def batch_finish(batch):
            stages[batch.rid]["c_checked"] = clock()
            finish(batch)

        self._patches = [(io_thread, "new_request_id", new_request_id), (pending.Requests, "add", requests_add),
                         (worker_replies.WorkerReplies, "on_data", data), (assembly._Batch, "__init__", batch_init),
                         (assembly._Batch, "_land", batch_land), (assembly._Batch, "_finish", batch_finish)]
        self._saved = [(owner, name, getattr(owner, name)) for owner, name, _ in self._patches]

    def __enter__(self) -> ClientStamps:
        for owner, name, fn in self._patches:
            setattr(owner, name, fn)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, fn in self._saved:
            setattr(owner, name, fn)


def _run(frontend: str, device: torch.device, mode: str, seq: int, prefetch: int, steps: int,
         stamps: ClientStamps) -> tuple[list[str], float]:
    """``steps`` batches of ``ROWS`` x ``seq`` at ``prefetch``, taken in order as a trainer does (two warm-up batches
    first): the timed requests' ids and the seconds per batch (from the first timed batch's resolution on)."""
    from spec_serve.client.api import RemoteTargetModel
    from spec_serve.tools.bench import make_batch
    from spec_serve.tools.null_engine import VOCAB, null_mapping

    compact, kind, _ = MODES[mode]
    batch = make_batch(ROWS, seq, VOCAB, 0)
    with RemoteTargetModel(frontend, service="standin", device=device, prefetch_depth=prefetch, timeout=600,
                           compact=compact, same_host_plane=False, verify="all") as client:
        client.set_vocab_mapping(*null_mapping())
        for _ in range(2):
            client.generate_batch(*batch, kind=kind)
        ids: list[str] = []
        in_flight: collections.deque = collections.deque()
        for _ in range(steps):
            future = client.generate_batch_async(*batch, kind=kind)
            rid = stamps.last
            future.add_done_callback(lambda _, rid=rid: stamps.stages[rid].setdefault("c_resolved", clock()))
            ids.append(rid)
            in_flight.append(future)
            if len(in_flight) > prefetch:
                in_flight.popleft().result()
        while in_flight:
            in_flight.popleft().result()
        if client.stats.digest_checks < steps or client.stats.digest_mismatches:
            raise RuntimeError(f"digests: {client.stats.digest_checks} checked, {client.stats.digest_mismatches} bad")
    resolved = [stamps.stages[r]["c_resolved"] for r in ids]
    return ids, (resolved[-1] - resolved[0]) / (len(ids) - 1)


def _reply_mb(mode: str, seq: int) -> float:
    from spec_serve.supervision.contract import Kind, reply_bytes, reply_specs
    from spec_serve.tools.null_engine import DRAFT_VOCAB, INFO

    return reply_bytes(reply_specs(Kind.parse(MODES[mode][2]), INFO, ROWS, seq, torch.int64, DRAFT_VOCAB)) / 1e6


def _medians(rows: list[dict[str, float]], prefetch: int) -> dict[str, float]:
    """Each stage's median (ms), and from a batch's resolution to the submission its credit lets go."""
    spans = [*zip(STAGES, STAGES[1:]), ("w_handed", "w_left")]
    medians = {f"{a}->{b}": round(statistics.median((r[b] - r[a]) * 1e3 for r in rows), 1) for a, b in spans
               if all(a in r and b in r for r in rows)}
    medians["c_resolved->next c_submit"] = round(statistics.median(
        (later["c_submit"] - r["c_resolved"]) * 1e3 for r, later in zip(rows, rows[prefetch:])), 1)
    return medians


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``ms = fixed + per_mb * MB``: (fixed, per_mb)."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return round(my - slope * mx, 1), round(slope, 3)


def _measure(device: torch.device, forward_ms: float, modes: list[str], seqs: list[int], depths: list[int],
             steps: int, gpu_8b: bool) -> tuple[list[tuple], dict[str, dict[str, float]]]:
    """Every (mode, length, depth) in turn against one worker: the runs ``(mode, seq, prefetch, ids, period)`` and
    every request's stages, the worker's merged in."""
    from spec_serve.tools.bench import LLAMA_8B_CONFIG
    from spec_serve.tools.launch import Cluster
    from spec_serve.tools.random_target import write_random_init_target

    runs = []
    with tempfile.TemporaryDirectory(prefix="spec-serve-way-back-") as tmp:
        worker_stamps = Path(tmp) / "worker.jsonl"
        target = str(write_random_init_target(Path(tmp) / "llama-8b-shape", LLAMA_8B_CONFIG)) if gpu_8b else ""
        cluster = Cluster.on_free_ports(env={"SPEC_SERVE_UNKNOWN_SERVICE_GRACE": "600"})
        cluster.start_broker()
        try:
            cluster.workers.append(subprocess.Popen(
                [sys.executable, __file__, "_worker", cluster.backend, str(device), str(forward_ms),
                 str(worker_stamps), target], env={"OMP_NUM_THREADS": "1", **os.environ}))
            cluster.wait_workers(1, timeout=300)
            with ClientStamps() as stamps:
                for mode in modes:
                    for seq in seqs:
                        for prefetch in depths:
                            ids, period = _run(cluster.frontend, device, mode, seq, prefetch, steps, stamps)
                            runs.append((mode, seq, prefetch, ids, period))
        finally:
            cluster.stop()
        for line in worker_stamps.read_text().splitlines():
            d = json.loads(line)
            stamps.stages[d["rid"]].setdefault(d["stage"], d["t"])
    return runs, stamps.stages


def _report(runs: list[tuple], stages: dict[str, dict[str, float]], report: dict) -> dict:
    """Each run's period and stage medians, and per mode the fit of each stage over the sizes at prefetch 1."""
    for mode, seq, prefetch, ids, period in runs:
        run = {"mode": mode, "seq": seq, "reply_mb": round(_reply_mb(mode, seq), 1), "prefetch": prefetch,
               "period_ms": round(period * 1e3, 1), "stages_ms": _medians([stages[r] for r in ids], prefetch)}
        report["runs"].append(run)
        print(json.dumps(run), flush=True)
    for mode in dict.fromkeys(run[0] for run in runs):
        ones = [r for r in report["runs"] if r["mode"] == mode and r["prefetch"] == 1]
        if len(ones) < 2:
            continue
        fits = {span: _fit([(r["reply_mb"], r["stages_ms"][span]) for r in ones]) for span in ones[0]["stages_ms"]}
        report["fits"][mode] = {span: {"fixed_ms": fixed, "ms_per_mb": per_mb}
                                for span, (fixed, per_mb) in fits.items()}
        print(f"{mode}, prefetch 1, each stage = fixed ms + ms per MB:", json.dumps(report["fits"][mode]), flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="the worker's and the client's device")
    parser.add_argument("--forward-ms", type=float, default=100.0, help="the emulated forward")
    parser.add_argument("--gpu-8b", action="store_true",
                        help="the worker runs the real forward: the Llama-3.1-8B shape, random weights, bf16")
    parser.add_argument("--modes", default="compact-wire,dspark", help=f"comma-separated: {', '.join(MODES)}")
    parser.add_argument("--seqs", default="256,768,1280", help="row lengths (4 rows a batch): the reply sizes")
    parser.add_argument("--prefetch", default="1,2,3", help="comma-separated depths")
    parser.add_argument("--steps", type=int, default=12, help="timed batches per (mode, length, depth)")
    parser.add_argument("--out", type=Path, default=None, help="folder for way_back.json")
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := sorted(set(modes) - MODES.keys()):
        parser.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    device = torch.device(args.device)
    runs, stages = _measure(device, args.forward_ms, modes, [int(s) for s in args.seqs.split(",")],
                            [int(p) for p in args.prefetch.split(",")], args.steps, args.gpu_8b)
    forward = "Llama-3.1-8B shape, random bf16 weights" if args.gpu_8b else f"emulated, {args.forward_ms:g} ms"
    report = _report(runs, stages, {"device": str(device), "forward": forward, "torch": torch.__version__,
                                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                                    "runs": [], "fits": {}})
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "way_back.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        _worker(sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5], sys.argv[6])
    else:
        main()
