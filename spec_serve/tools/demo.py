"""``spec-serve demo``: the whole system on the built-in tiny target, every tensor verified."""

from __future__ import annotations

import concurrent.futures
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import torch

from spec_serve.client.api import RemoteTargetModel
from spec_serve.engines.hf import HFTarget
from spec_serve.supervision.vocab import build_vocab_mapping
from spec_serve.tools.launch import local_cluster
from spec_serve.tools.tiny import make_tiny_target, sample_batch
from spec_serve.tools.verify import check_contract

KINDS = ("eagle3", "dspark")


@dataclass
class RankReport:
    rank: int
    shards: int
    requests: int = 0
    tokens: int = 0
    bytes: int = 0
    verified: int = 0
    mismatched: int = 0
    retried: int = 0
    within_tolerance: int = 0  # sharded batches the kernels computed otherwise than the whole batch


def _nbytes(batch: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in batch.values())


def run_rank(rank: int, broker: str, reference: HFTarget, target_dir: str, mapping, steps: int, batch: int,
             seq: int, tick, shards: int) -> RankReport:
    """One training rank: prefetch depth 2, alternating kinds, each result checked against the contract:
    each shard bit for bit, the assembled batch against the whole batch's forward (docs/equality.md)."""
    report = RankReport(rank, shards)
    # wire_dtype pinned to the model dtype: the demo shows bit-equality (FP8 on the wire is within a stated error)
    with RemoteTargetModel(broker, prefetch_depth=2, num_shards=shards, timeout=60, wire_dtype="auto") as target:
        target.check_target_info(reference.target_info())
        target.set_vocab_mapping(*mapping)
        inflight: list[tuple[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor], Any]] = []
        for step in range(steps):
            kind = KINDS[step % 2]
            ids, attn, loss = sample_batch(target_dir, batch, seq, seed=1000 * rank + step)
            inflight.append((kind, (ids, attn, loss), target.generate_batch_async(ids, attn, loss, kind=kind)))
            if len(inflight) == 2 or step == steps - 1:
                while inflight:
                    kind, inputs, future = inflight.pop(0)
                    got = future.result()
                    check = check_contract(got, reference, inputs, kind, shards=shards)
                    report.requests += 1
                    report.tokens += int(inputs[1].sum())
                    report.bytes += _nbytes(got)
                    report.verified += check.ok
                    report.mismatched += not check.ok
                    report.within_tolerance += check.ok and not check.invariant
                    if not check.ok:
                        click.echo(f"\nrank {rank}: {check.describe()}", err=True)
                    tick()
        report.retried = target.stats.retried
    return report


def run_demo(ranks: int = 3, workers: int = 2, steps: int = 6, batch: int = 4, seq: int = 64,
             target: str | None = None) -> bool:
    """Build, launch, run, verify, report; True when every tensor matched."""
    with tempfile.TemporaryDirectory(prefix="spec-serve-demo-") as tmp:
        if target is None:
            click.echo("building the tiny target (random Llama, local tokenizer) ...")
            target = str(make_tiny_target(Path(tmp) / "tiny"))
        # The colocated references run with the workers' math threads (launch: OMP_NUM_THREADS, 1 unless
        # set): on a CPU another thread count may give other low bits (docs/equality.md).
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        reference = HFTarget(target)
        ids, attn, loss = sample_batch(target, 16, seq, seed=7)
        mapping = build_vocab_mapping(ids, loss, reference.vocab_size, reference.vocab_size // 2)
        reference.set_vocab_mapping(*mapping)
        click.echo(f"starting a broker and {workers} workers ...")
        with local_cluster(target, workers=workers) as cluster:
            click.echo(f"broker at {cluster.frontend}; {workers} workers ready; running {ranks} ranks")
            lock = threading.Lock()
            start = time.perf_counter()
            with click.progressbar(length=ranks * steps, label="supervision batches") as bar:
                def tick():
                    with lock:
                        bar.update(1)
                with concurrent.futures.ThreadPoolExecutor(ranks) as pool:
                    futures = [pool.submit(run_rank, r, cluster.frontend, reference, target, mapping, steps, batch, seq,
                                           tick, 1 + (r % 2) * (workers - 1)) for r in range(ranks)]
                    reports = [f.result() for f in futures]
            elapsed = time.perf_counter() - start
        _print_table(reports, elapsed)
    ok = all(r.mismatched == 0 for r in reports)
    within = sum(r.within_tolerance for r in reports)
    note = f"; {within} sharded batches within the tolerance of the whole batch's forward" if within else ""
    click.echo(f"all tensors equal to the colocated forward{note}" if ok
               else "MISMATCH against the colocated forward")
    return ok


def _print_table(reports: list[RankReport], elapsed: float) -> None:
    click.echo(f"\n{'rank':>4} {'shards':>6} {'requests':>8} {'tokens':>8} {'tokens/s':>9} {'bytes/token':>11} "
               f"{'verified':>8} {'retried':>7}")
    for r in reports:
        click.echo(f"{r.rank:>4} {r.shards:>6} {r.requests:>8} {r.tokens:>8} {r.tokens / elapsed:>9.0f} "
                   f"{r.bytes / max(r.tokens, 1):>11.0f} {r.verified:>4}/{r.requests:<3} {r.retried:>7}")
    tokens = sum(r.tokens for r in reports)
    click.echo(f"{'all':>4} {'':>6} {sum(r.requests for r in reports):>8} {tokens:>8} {tokens / elapsed:>9.0f} "
               f"{sum(r.bytes for r in reports) / max(tokens, 1):>11.0f} "
               f"{sum(r.verified for r in reports):>4}/{sum(r.requests for r in reports):<3} "
               f"{sum(r.retried for r in reports):>7}")
