"""The worker's host slabs on training rows: slabs made, and seconds spent pinning them, per batch.

A GPU worker copies each reply into a pinned slab of its ``HostBufferPool`` (paths/frames/hostpool.py) before
ZeroMQ sends it, on the compute thread: the next forward starts only once the slab exists. This replays the
bench's workload (``spec-serve bench --lengths lognormal``: 4 rows of at most 2048 tokens, each batch padded
to its longest) at the 8B shape's reply sizes through one pool of 4 slabs, each slab lent until three later
batches were taken (a worker of capacity 2 while libzmq sends), and times every ``acquire``. No model: the
pool alone, in a fresh process (torch caches freed pinned blocks per process, so one kind a process).

    python benchmarks/bench_host_slabs.py --kind compact --json slabs.json

Run it with ``PYTHONPATH`` at another checkout to measure that checkout's pool on the same workload.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch

# Reply bytes a token at the Llama-3.1-8B shape (Vd 32000, bf16): BENCHMARKS.md, issues 25 and 40.
BYTES_PER_TOKEN = {"full": 152_593, "compact": 32_788, "dspark": 49_152}
ROWS, SEQ, MAX_SLABS, SENDING = 4, 2048, 4, 3


def main() -> None:
    from spec_serve.paths.frames.hostpool import HostBufferPool
    from spec_serve.tools.bench import row_lengths

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=sorted(BYTES_PER_TOKEN), default="compact")
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    pool = HostBufferPool(max_buffers=MAX_SLABS)
    sending: collections.deque = collections.deque()
    made, seconds = [], []
    for rows in row_lengths("lognormal", args.batches, ROWS, SEQ):
        before, start = pool.allocations, time.perf_counter()
        sending.append(pool.acquire(ROWS * max(rows) * BYTES_PER_TOKEN[args.kind]))
        seconds.append(time.perf_counter() - start)
        made.append(pool.allocations - before)
        if len(sending) > SENDING:
            sending.popleft().release()
    report = {"kind": args.kind, "pinned": pool.pin, "batches": args.batches, "slabs_made": sum(made),
              "made_at": [i for i, n in enumerate(made) if n], "acquire_seconds": round(sum(seconds), 4),
              "acquire_seconds_first_14": round(sum(seconds[:14]), 4),
              "acquire_seconds_after_14": round(sum(seconds[14:]), 4), "slowest_ms": round(max(seconds) * 1e3, 1),
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    print(json.dumps(report), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
