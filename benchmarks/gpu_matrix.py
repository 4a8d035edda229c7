"""GPU equality matrix (issue 12): every remote data path against the colocated forward, batch by batch.

One worker serves the Llama-3.1-8B shape (random bf16 weights built on the GPU, aux layers 1,15,28)
on the first device; this process holds the colocated ``HFTarget`` on the same device and checks
every batch a client gets against the contract (docs/equality.md), as ``spec_serve.tools.verify``
computes it: ``torch.equal`` to the colocated forward of each shard's rows (compact expanded on the
client's device); and, sharded, the assembled batch against the unsharded forward: bit-equal where the
kernels are batch-invariant, else within the target's derived tolerance. Cells:

  frames  EAGLE-3 full and compact  x  prefetch 1, 2, 4  x  shards 1, 2  x  client on the worker's
          GPU and (when there are two) on another one (the same-host plane off)
  frames  DSpark, prefetch 2, on each client device
  plane   the same-host plane (CUDA IPC): EAGLE-3 full and compact x shards 1, 2, and DSpark, prefetch
          2, on each client device
  nccl    EAGLE-3 full and compact, client on another device (NCCL pairs two GPUs; on CPU: gloo)
  auto    the client's default, compact="auto": frames (shards 1, 2: the worker answers compact, checked
          against the colocated compact batch expanded; ``equal_to_full`` counts the batches also bit-equal to
          the full forward), the plane and NCCL (same host: the worker answers full)

Prints one line per cell as it finishes and a matrix of equal/total at the end; writes JSON after
every cell (a run cut short still leaves its cells). A cell that fails or outlives ``--cell-timeout``
is reported as such and the run goes on. Exit status 0 only when every cell that ran is all equal.

  python benchmarks/gpu_matrix.py --json $OUT/gpu_matrix.json        # H200 (see gpu_matrix.sh)
  python benchmarks/gpu_matrix.py --tiny --device cpu                # the tiny target on CPU, in CI
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import platform
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from spec_serve.tools.bench import LLAMA_8B_AUX_LAYERS, LLAMA_8B_CONFIG  # noqa: E402
from spec_serve.tools.verify import (  # noqa: E402
    composition,
    expanded,
    mismatch,
    reference_logits,
    sharded_forward,
    tolerance_for,
)


@dataclasses.dataclass(frozen=True)
class Cell:
    path: str  # "frames", "plane" (the same-host plane) or "nccl"
    kind: str  # "eagle3" or "dspark"
    compact: bool | str  # True, False or "auto" (the worker picks by path)
    prefetch: int
    shards: int
    client_device: str

    @property
    def compact_wire(self) -> bool:
        """Whether its replies travel compact: compact=True, or "auto" over frames (the same host otherwise)."""
        return self.compact is True or (self.compact == "auto" and self.path == "frames")

    @property
    def name(self) -> str:
        what = f"{self.kind}{'_compact' if self.compact is True else '_auto' if self.compact == 'auto' else ''}"
        return f"{self.path:<6} {what:<15} p{self.prefetch} s{self.shards} client {self.client_device}"


def plan(devices: list[str]) -> tuple[list[Cell], list[tuple[str, str]]]:
    """The cells to run on ``devices`` (the worker on the first), and (cell, reason) for those skipped."""
    worker, others = devices[0], devices[1:2]
    cells, skipped = [], []
    for client in (worker, *others):
        for compact in (False, True):
            for prefetch in (1, 2, 4):
                for shards in (1, 2):
                    cells.append(Cell("frames", "eagle3", compact, prefetch, shards, client))
        cells.append(Cell("frames", "dspark", False, 2, 1, client))
        cells += [Cell("frames", "eagle3", "auto", 2, shards, client) for shards in (1, 2)]
        for compact in (False, True):
            for shards in (1, 2):
                cells.append(Cell("plane", "eagle3", compact, 2, shards, client))
        cells.append(Cell("plane", "dspark", False, 2, 1, client))
        cells.append(Cell("plane", "eagle3", "auto", 2, 2, client))
    if not others and worker.startswith("cuda"):
        skipped.append(("client on another GPU", "one GPU here"))
    nccl_client = others[0] if others else (worker if worker == "cpu" else None)
    for compact in (False, True, "auto"):
        cell = Cell("nccl", "eagle3", compact, 2, 1, nccl_client or "cuda:1")
        if nccl_client is None:
            skipped.append((f"nccl {cell.name.split()[1]}", "NCCL pairs two GPUs; one GPU here"))
        else:
            cells.append(cell)
    return cells, skipped


def make_batches(count: int, rows: int, seq: int, vocab: int) -> list[tuple[torch.Tensor, ...]]:
    """Right-padded batches: row 0 full, the others of random lengths in [seq/2, seq]; loss on the
    last three quarters of each row's tokens."""
    out = []
    for seed in range(count):
        gen = torch.Generator().manual_seed(seed)
        lengths = [seq] + [int(n) for n in torch.randint(seq // 2, seq + 1, (rows - 1,), generator=gen)]
        ids = torch.randint(0, vocab, (rows, seq), generator=gen)
        attn = torch.zeros(rows, seq, dtype=torch.int64)
        loss = torch.zeros(rows, seq, dtype=torch.int64)
        for r, n in enumerate(lengths):
            attn[r, :n] = 1
            loss[r, n // 4 : n] = 1
        out.append((ids * attn, attn, loss))
    return out


class References:
    """Colocated answers, each computed once: raw outputs per (batch, wire kind, shards) on the engine's
    device; compact ones expanded per client device when asked."""

    def __init__(self, engine, batches, mapping):
        from spec_serve.supervision.eagle3 import lm_head_slice

        self.engine, self.batches, self.mapping = engine, batches, mapping
        self.lm_head = lm_head_slice(engine.get_output_embeddings().weight, mapping[0])
        self.tolerance = tolerance_for(engine)
        self._raw: dict = {}
        self._logits: dict = {}
        self._compositions: dict = {}

    def get(self, i: int, cell: Cell, shards: int | None = None) -> dict[str, torch.Tensor]:
        shards = cell.shards if shards is None else shards
        wire_kind = "eagle3_compact" if cell.compact_wire else cell.kind
        key = (i, wire_kind, shards)
        if key not in self._raw:
            self._raw[key] = sharded_forward(self.engine, self.batches[i], wire_kind, shards)
        raw = self._raw[key]
        return expanded(raw, self.lm_head, self.mapping[1], cell.client_device) if cell.compact_wire else raw

    def composition(self, i: int, cell: Cell) -> dict:
        """The contract's second part for batch ``i`` as ``cell``'s client assembles it: the per-shard
        reference against the unsharded one, both colocated. ``invariant``: bit-equal; else ``violations``
        of the tolerance (none: within it) and the ``deviation`` measured."""
        key = (i, cell.kind, cell.compact_wire, cell.shards, cell.client_device)
        if key not in self._compositions:
            part2 = composition(self.get(i, cell), self.get(i, cell, shards=1), self.tolerance,
                                lambda: None if cell.kind == "dspark" else self._reference_logits(i))
            self._compositions[key] = {"invariant": True, "violations": []} if part2.invariant else {
                "invariant": False, "deviation": part2.deviation, "violations": part2.violations}
        return self._compositions[key]

    def _reference_logits(self, i: int):
        """Batch ``i``'s unsharded logits, computed once (a forward) for every cell that needs them."""
        if i not in self._logits:
            self._logits[i] = reference_logits(self.engine, self.batches[i])
        return self._logits[i]


def run_cell(cell: Cell, frontend: str, refs: References, request_timeout: float, verify: str) -> dict:
    """Every batch of ``refs`` through one client configured as ``cell``; counts equal batches. With the
    end-to-end digest on (``verify``), a reply it caught (and had computed again) fails the cell too."""
    from spec_serve.client.api import RemoteTargetModel

    row: dict = {"equal": 0, "total": len(refs.batches), "first_mismatch": None}
    if cell.shards > 1:  # the assembled batch against the unsharded forward: bit-equal, or within the tolerance
        row.update(unsharded_equal=0, unsharded_within=0, first_violation=None)
    full = dataclasses.replace(cell, compact=False)
    if cell.compact == "auto" and cell.compact_wire:
        row["equal_to_full"] = 0  # informative: compact expanded here against the full forward, bit for bit
    with RemoteTargetModel(frontend, device=cell.client_device, prefetch_depth=cell.prefetch, num_shards=cell.shards,
                           compact=cell.compact, enable_nccl=cell.path == "nccl", timeout=request_timeout,
                           max_retries=1, verify=verify, same_host_plane=cell.path == "plane") as client:
        client.set_vocab_mapping(*refs.mapping)
        futures = [client.generate_batch_async(*b, kind=cell.kind) for b in refs.batches]
        for i, future in enumerate(futures):
            got = future.result(timeout=request_timeout)
            wrong = mismatch(got, refs.get(i, cell))
            row["equal"] += wrong is None
            if wrong is not None and row["first_mismatch"] is None:
                row["first_mismatch"] = f"batch {i}: {wrong}"
            if cell.shards > 1:
                _count_composition(row, i, refs.composition(i, cell))
            if "equal_to_full" in row:
                row["equal_to_full"] += mismatch(got, refs.get(i, full)) is None
            del got
        stats = client.stats
    row.update(retried=stats.retried, nccl_batches=stats.nccl_batches, nccl_fallbacks=stats.nccl_fallbacks,
               digest_checks=stats.digest_checks, digest_mismatches=stats.digest_mismatches,
               plane_replies=stats.plane_replies, plane_fallbacks=stats.plane_fallbacks,
               compact_replies=stats.compact_replies, lm_head_slices=stats.lm_head_slices)
    if cell.path == "nccl" and stats.nccl_batches < row["total"]:
        row["note"] = f"only {stats.nccl_batches} of {row['total']} batches came over NCCL (fell back to frames)"
    if cell.path == "plane" and stats.plane_replies < row["total"] * cell.shards:
        row["note"] = f"only {stats.plane_replies} of {row['total'] * cell.shards} replies came through the plane"
    if cell.compact == "auto" and stats.compact_replies != (row["total"] * cell.shards if cell.compact_wire else 0):
        row["format"] = f"{stats.compact_replies} of {row['total'] * cell.shards} replies came compact"
    return row


def _count_composition(row: dict, i: int, composition: dict) -> None:
    if composition["invariant"]:
        row["unsharded_equal"] += 1
    elif not composition["violations"]:
        row["unsharded_within"] += 1
        row["worst_deviation"] = composition["deviation"]
    elif row["first_violation"] is None:
        row["first_violation"] = f"batch {i}: " + "; ".join(composition["violations"])


def run_with_timeout(cell: Cell, frontend: str, refs: References, cell_timeout: float, verify: str = "all") -> dict:
    """``run_cell`` in a thread of its own: a cell that hangs is reported and left behind."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="matrix-cell")
    start = time.monotonic()
    future = pool.submit(run_cell, cell, frontend, refs, cell_timeout, verify)
    try:
        row = future.result(timeout=cell_timeout)
        row["status"] = _status(row)
    except concurrent.futures.TimeoutError:
        row = {"status": "timeout", "error": f"not done within {cell_timeout:g}s"}
    except Exception as e:  # reported per cell; the matrix goes on
        row = {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
    pool.shutdown(wait=False)
    row["seconds"] = round(time.monotonic() - start, 2)
    return {**dataclasses.asdict(cell), "cell": cell.name, **row}


def _status(row: dict) -> str:
    """ok only when every batch met the contract (each shard bit-equal; sharded, the assembled batch bit-equal
    to the unsharded forward or within the tolerance), no reply failed the digest (the path corrupted it,
    even if the retry came back right) and an NCCL cell really used NCCL."""
    if row["equal"] != row["total"]:
        return "DIFFERS"
    if "unsharded_equal" in row and row["unsharded_equal"] + row["unsharded_within"] != row["total"]:
        return "OUTSIDE_TOLERANCE"
    if row.get("digest_mismatches"):
        return "DIGEST"
    if row.get("format"):
        return "FORMAT"  # compact="auto" answered otherwise than its rule says
    return "fallback" if row.get("note") else "ok"


def start_worker(target: Path, device: str, gpu_8b: bool, log_dir: Path | None):
    from spec_serve.tools.launch import Cluster

    cluster = Cluster.on_free_ports(env={"SPEC_SERVE_UNKNOWN_SERVICE_GRACE": "900"}, log_dir=log_dir)
    cluster.start_broker()
    extra = ["--dtype", "bfloat16", "--aux-layer-ids", LLAMA_8B_AUX_LAYERS] if gpu_8b else []
    cluster.start_worker(target, "--device", device, *extra)
    return cluster


def load_colocated(target: Path, device: str, gpu_8b: bool):
    from spec_serve.engines.hf import HFTarget

    if gpu_8b:
        return HFTarget(target, device=device, dtype="bfloat16",
                        aux_layer_ids=[int(i) for i in LLAMA_8B_AUX_LAYERS.split(",")])
    return HFTarget(target, device=device)


def format_matrix(rows: list[dict], skipped: list[tuple[str, str]]) -> str:
    lines = [f"{'cell':<58}{'equal':>9}  status", "-" * 80]
    for r in rows:
        equal = f"{r['equal']}/{r['total']}" if "total" in r else "-"
        extra = r.get("first_mismatch") or r.get("error") or r.get("note") or ""
        if r.get("digest_mismatches"):
            extra = (extra + "; " if extra else "") + f"{r['digest_mismatches']} replies failed the digest check"
        if "unsharded_equal" in r:
            extra = (extra + "; " if extra else "") + (f"unsharded: equal {r['unsharded_equal']}, within tolerance "
                                                       f"{r['unsharded_within']} of {r['total']}")
            if r.get("first_violation"):
                extra += f"; {r['first_violation']}"
        if "equal_to_full" in r:
            extra = (extra + "; " if extra else "") + f"full-equal {r['equal_to_full']}/{r['total']}"
        if r.get("format"):
            extra = (extra + "; " if extra else "") + r["format"]
        lines.append(f"{r['cell']:<58}{equal:>9}  {r['status']}  {extra}".rstrip())
    for what, why in skipped:
        lines.append(f"{what:<58}{'-':>9}  skipped  {why}")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="the built-in tiny target instead of the 8B shape")
    p.add_argument("--device", default=None, help="worker (and colocated) device; default cuda:0, or cpu")
    p.add_argument("--client-device", default=None, help="the other client device; default cuda:1 if present")
    p.add_argument("--batches", type=int, default=4, help="batches per cell")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seq", type=int, default=None, help="tokens per row [2048; 64 with --tiny]")
    p.add_argument("--draft-vocab", type=int, default=None, help="[32000; 256 with --tiny]")
    p.add_argument("--cell-timeout", type=float, default=150.0, help="seconds one cell may take")
    p.add_argument("--budget", type=float, default=420.0,
                   help="seconds for the whole run; cells not started by then are reported as not run")
    p.add_argument("--verify", default="all", choices=("all", "sampled", "off"),
                   help="the clients' end-to-end digest check (a reply it catches fails the cell)")
    p.add_argument("--only", default="", help="run only cells whose name contains one of these, comma-separated")
    p.add_argument("--json", default=None, help="report path; default $OUT/gpu_matrix.json or ./gpu_matrix.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # run the clean-up and print what ran
    device = a.device or ("cpu" if a.tiny or not torch.cuda.is_available() else "cuda:0")
    others = [a.client_device] if a.client_device else (
        ["cuda:1"] if device.startswith("cuda") and torch.cuda.device_count() > 1 else [])
    seq, draft_vocab = a.seq or (64 if a.tiny else 2048), a.draft_vocab or (256 if a.tiny else 32000)
    out_path = Path(a.json or Path(os.environ.get("OUT", ".")) / "gpu_matrix.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    cells, skipped = plan([device, *others])
    only = [s.strip() for s in a.only.split(",") if s.strip()]
    cells = [c for c in cells if not only or any(s in c.name for s in only)]
    report = {"when": time.strftime("%Y-%m-%d %H:%M:%S %z"), "machine": {
        "host": platform.node(), "torch": torch.__version__,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]},
        "config": {"target": "tiny" if a.tiny else "llama-3.1-8b-shape-random-bf16", "device": device,
                   "other_client_devices": others, "batches": a.batches, "rows": a.rows, "seq": seq,
                   "draft_vocab": draft_vocab, "verify": a.verify}, "cells": [], "skipped": skipped}
    with tempfile.TemporaryDirectory(prefix="spec-serve-matrix-") as tmp:
        return _run(a, device, seq, draft_vocab, cells, skipped, report, out_path, Path(tmp))


def _run(a, device, seq, draft_vocab, cells, skipped, report, out_path: Path, tmp: Path) -> int:
    from spec_serve.supervision.vocab import build_vocab_mapping
    from spec_serve.tools.random_target import write_random_init_target
    from spec_serve.tools.tiny import make_tiny_target

    started = time.monotonic()
    target = make_tiny_target(tmp / "tiny") if a.tiny else write_random_init_target(tmp / "8b", LLAMA_8B_CONFIG)
    log_dir = out_path.parent / "matrix-logs"
    cluster = start_worker(target, device, not a.tiny, log_dir)  # loads while we do
    try:
        engine = load_colocated(target, device, not a.tiny)
        vocab = engine.vocab_size
        batches = make_batches(a.batches, a.rows, seq, vocab)
        ids, _, loss = (torch.cat(t) for t in zip(*batches))
        mapping = build_vocab_mapping(ids, loss, vocab, min(draft_vocab, vocab))
        engine.set_vocab_mapping(*mapping)
        refs = References(engine, batches, mapping)
        cluster.wait_workers(1, timeout=600)
        print(f"[matrix] ready after {time.monotonic() - started:.0f}s: {len(cells)} cells, "
              f"{a.batches} batches of {a.rows}x{seq} each", flush=True)
        for cell in cells:
            if time.monotonic() - started > a.budget:
                skipped.append((cell.name, f"not run: the {a.budget:g}s budget was spent"))
                continue
            row = run_with_timeout(cell, cluster.frontend, refs, a.cell_timeout, a.verify)
            report["cells"].append(row)
            print(f"[matrix] {row['cell']}: {row.get('equal', '-')}/{row.get('total', '-')} {row['status']} "
                  f"({row['seconds']}s) {row.get('first_mismatch') or row.get('error') or ''}", flush=True)
            out_path.write_text(json.dumps(report, indent=2) + "\n")
    finally:  # also when cut short (SIGTERM from `timeout`): stop the workers, show what ran
        cluster.stop()
        report["seconds"] = round(time.monotonic() - started, 1)
        report["all_equal"] = bool(report["cells"]) and all(r["status"] == "ok" for r in report["cells"]) \
            and len(report["cells"]) == len(cells)
        out_path.write_text(json.dumps(report, indent=2) + "\n")
        print(format_matrix(report["cells"], skipped))
        print(f"[matrix] {'ALL EQUAL' if report['all_equal'] else 'NOT ALL EQUAL'}: {len(report['cells'])} of "
              f"{len(cells)} cells ran in {report['seconds']}s; wrote {out_path}", flush=True)
    return 0 if report["all_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
