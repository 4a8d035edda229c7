"""``spec-serve capture``: run a dataset of token ids through the running workers into a cache directory,
with the online cache's keys (offline mode; docs/cache.md).

Rows already in the cache are skipped (a second run resumes where the first stopped). The rest are sorted
by length and cut into batches of at most ``batch_tokens`` padded tokens, sent through one client with
``in_flight`` batches outstanding, which the broker spreads over every worker of the service.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import torch

from spec_serve.cache.rows import stored_kind
from spec_serve.supervision.contract import Kind


def read_rows(path: str | Path) -> list[torch.Tensor]:
    """One ``{"input_ids": [int, ...]}`` a line (blank lines skipped): ``ValueError`` naming a bad line."""
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ids = json.loads(line)["input_ids"]
                if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                    raise ValueError
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path}:{number}: expected {{\"input_ids\": [int, ...]}} with at least one "
                                 "id") from None
            rows.append(torch.tensor(ids, dtype=torch.int64))
    return rows


def plan_batches(lengths: list[int], batch_tokens: int, max_rows: int) -> list[list[int]]:
    """Row indices in batches, longest rows first, each at most ``batch_tokens`` padded tokens (a longer
    row alone) and ``max_rows`` rows."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        current = batches[-1] if batches else None
        # Rows come longest first, so a batch's padded length is its first row's.
        if current and len(current) < max_rows and (len(current) + 1) * lengths[current[0]] <= batch_tokens:
            current.append(i)
        else:
            batches.append([i])
    return batches


def padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, loss_mask)`` of ``rows`` right-padded with id 0 (loss on every real token)."""
    seq = max(r.numel() for r in rows)
    ids = torch.zeros(len(rows), seq, dtype=torch.int64)
    mask = torch.zeros(len(rows), seq, dtype=torch.int64)
    for i, r in enumerate(rows):
        ids[i, : r.numel()] = r
        mask[i, : r.numel()] = 1
    return ids, mask, mask.clone()


class Progress:
    """Tokens done of a total, tokens/s and an ETA: redrawn in place on a terminal, else a line every
    ``every`` seconds."""

    def __init__(self, total: int, stream: TextIO = sys.stderr, every: float = 10.0):
        self.total, self.done, self.stream, self.every = total, 0, stream, every
        self.start = self.last = time.monotonic()
        self.tty = stream.isatty()
        self._lock = threading.Lock()  # batches land on several threads

    def add(self, tokens: int) -> None:
        with self._lock:
            self._add(tokens)

    def _add(self, tokens: int) -> None:
        self.done += tokens
        now = time.monotonic()
        if self.tty or now - self.last >= self.every or self.done >= self.total:
            self.last = now
            self.stream.write(("\r" if self.tty else "") + self.line() + ("" if self.tty else "\n"))
            self.stream.flush()

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        percent = 100 * self.done / self.total if self.total else 100.0
        return (f"[capture] {self.done:,}/{self.total:,} tokens ({percent:.1f}%)  {rate:,.0f} tokens/s  "
                f"ETA {_duration(eta)}")

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")


def _duration(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    minutes, s = divmod(int(seconds + 0.5), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}h{m:02d}m" if hours else f"{m}m{s:02d}s"


def _counted(bar: Progress, tokens: int) -> Callable[[Any], None]:
    def done(future: Any) -> None:
        if future.exception() is None:
            bar.add(tokens)
    return done


def capture(client: Any, rows: list[torch.Tensor], kind: str, batch_tokens: int, max_rows: int,
            progress: Callable[[int], Progress] = Progress) -> dict[str, Any]:
    """Fill ``client``'s cache (``RemoteTargetModel(cache=...)``) with ``rows`` of ``kind``; a summary."""
    stored = stored_kind(Kind.parse(kind)).value  # what the cache keeps, asked for as it is kept
    front = client.cache
    keys = [front.keys(r.unsqueeze(0), torch.ones(1, r.numel(), dtype=torch.int64), stored)[0] for r in rows]
    todo = [i for i, key in enumerate(keys) if key not in front.store]
    batches = plan_batches([rows[i].numel() for i in todo], batch_tokens, max_rows)
    bar = progress(sum(rows[i].numel() for i in todo))
    started = time.monotonic()
    futures = []
    for batch in batches:
        chosen = [rows[todo[j]] for j in batch]
        future = client.generate_batch_async(*padded(chosen), kind=stored)  # blocks at in_flight outstanding
        future.add_done_callback(_counted(bar, sum(r.numel() for r in chosen)))
        futures.append(future)
    for future in futures:
        future.result()  # a failure stops the run: what was stored stays, and the next run resumes there
    front.flush()
    bar.close()
    elapsed = time.monotonic() - started
    tokens = sum(rows[i].numel() for i in todo)
    return {"rows": len(rows), "skipped": len(rows) - len(todo), "captured": len(todo), "batches": len(batches),
            "tokens": tokens, "seconds": round(elapsed, 3), "tokens_per_s": tokens / elapsed if elapsed else None}
