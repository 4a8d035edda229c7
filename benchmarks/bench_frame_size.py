"""What the size of a reply's frames costs a receiver: ZeroMQ PUSH -> PULL over loopback, messages of
``--message-mib`` MiB cut into frames of each size in ``--frames-kib``, the receiver copying every frame into one
reused buffer as the client assembles a tensor (spec_serve/paths/frames/hostpool.py), in alternating order.

libzmq receives each frame into memory of its own from malloc. Per size: GB/s from the first message to the last,
the receiving process's minor page faults and CPU seconds. Each message carries its index in every frame's first
bytes and a pattern elsewhere; every frame's index and size are checked as it lands, and the last message of each
figure byte for byte (``verified``).

  python benchmarks/bench_frame_size.py --json frames.json          # 16 MiB against 1 MiB, 3 rounds of 8 GiB
  python benchmarks/bench_frame_size.py --frames-kib 16384,4096,1024,256 --gib 2 --rounds 1
  python benchmarks/bench_frame_size.py --no-assemble       # libzmq's receive alone (the client's ZMQ thread)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import zmq

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from spec_serve.transport.sockets import send_lent  # noqa: E402


def _pattern(message_bytes: int) -> np.ndarray:
    return (np.arange(message_bytes, dtype=np.uint64) * 2654435761 % 251).astype(np.uint8)


def _stamp(data: np.ndarray, frame_bytes: int, index: int) -> None:
    """Write ``index`` into the first 8 bytes of every frame of ``data``."""
    stamp = np.frombuffer(index.to_bytes(8, "little"), dtype=np.uint8)
    for lo in range(0, data.size, frame_bytes):
        data[lo : lo + 8] = stamp


def _send(port: int, message_bytes: int, frame_bytes: int, count: int) -> None:
    """Send ``count`` messages zero-copy from two buffers in turn; a buffer is stamped again only once libzmq let
    go of the message before (its tracker), as the worker lends its slabs."""
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    buffers = [_pattern(message_bytes), _pattern(message_bytes)]
    trackers: list[zmq.MessageTracker | None] = [None, None]
    for index in range(count):
        data, tracker = buffers[index % 2], trackers[index % 2]
        if tracker is not None:
            tracker.wait()
        _stamp(data, frame_bytes, index)
        frames = [memoryview(data)[lo : lo + frame_bytes] for lo in range(0, message_bytes, frame_bytes)]
        trackers[index % 2] = send_lent(push, frames)
    push.close(linger=-1)
    ctx.term()


def figure(message_bytes: int, frame_bytes: int, total_bytes: int, assemble: bool = True) -> dict:
    """Receive ``total_bytes`` in messages of ``message_bytes`` cut in frames of ``frame_bytes`` (each frame copied
    into one reused buffer when ``assemble``; else only its stamp read: what libzmq's receive thread alone does)."""
    count = max(total_bytes // message_bytes, 2)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    sender = multiprocessing.get_context("spawn").Process(target=_send, args=(port, message_bytes, frame_bytes,
                                                                               count))
    sender.start()
    into = np.empty(message_bytes, dtype=np.uint8)
    bad = 0
    start = usage = None
    for index in range(count):
        parts = pull.recv_multipart(copy=False)
        if index == 0:  # timed from the first message landed: the sender's start-up is left out
            start, usage = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        offset = 0
        for part in parts:
            view = np.frombuffer(part.buffer, dtype=np.uint8)
            if assemble or index == count - 1:
                into[offset : offset + view.size] = view
            bad += int.from_bytes(view[:8].tobytes(), "little") != index or view.size > frame_bytes
            offset += view.size
        bad += offset != message_bytes
        del parts
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    sender.join()
    pull.close()
    ctx.term()
    want = _pattern(message_bytes)
    _stamp(want, frame_bytes, count - 1)
    verified = bad == 0 and np.array_equal(into, want)
    moved = (count - 1) * message_bytes
    return {"frame_kib": frame_bytes >> 10, "messages": count, "gb_per_s": moved / seconds / 1e9,
            "minor_faults": after.ru_minflt - usage.ru_minflt,
            "cpu_s": after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime, "seconds": seconds,
            "verified": verified}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames-kib", default="16384,1024", help="frame sizes in KiB, comma-separated [16384,1024]")
    p.add_argument("--message-mib", type=int, default=128, help="one message (a reply) [128]")
    p.add_argument("--gib", type=float, default=8, help="bytes per figure [8]")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-assemble", action="store_true", help="read each frame's stamp only, copy nothing")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    sizes = [int(k) << 10 for k in a.frames_kib.split(",")]
    figures: dict[int, list[dict]] = {size: [] for size in sizes}
    for r in range(a.rounds):
        for size in sizes if r % 2 == 0 else sizes[::-1]:
            got = figure(a.message_mib << 20, size, int(a.gib * (1 << 30)), not a.no_assemble)
            figures[size].append(got)
            print(f"[frames] round {r + 1}: {size >> 10:>6} KiB frames {got['gb_per_s']:.2f} GB/s, "
                  f"{got['minor_faults']:,} faults, {got['cpu_s']:.2f} CPU-s in {got['seconds']:.2f} s, "
                  f"verified={got['verified']}", file=sys.stderr, flush=True)
    base = sizes[0]
    summary = {size >> 10: {"gb_per_s": round(statistics.median(f["gb_per_s"] for f in figs), 3),
                            f"over_{base >> 10}_kib": [round(f["gb_per_s"] / b["gb_per_s"], 3)
                                                       for f, b in zip(figs, figures[base])]}
               for size, figs in figures.items()}
    ok = all(f["verified"] for figs in figures.values() for f in figs)
    for kib, row in summary.items():
        print(f"{kib:>6} KiB frames: {row['gb_per_s']:.2f} GB/s (median), over {base >> 10} KiB: "
              f"{row[f'over_{base >> 10}_kib']}")
    print("verified" if ok else "NOT verified")
    if a.json:
        report = {"when": time.strftime("%Y-%m-%d %H:%M:%S %z"), "message_mib": a.message_mib, "gib": a.gib,
                  "assembled": not a.no_assemble,
                  "summary": summary, "figures": {size >> 10: figs for size, figs in figures.items()}, "ok": ok}
        Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
