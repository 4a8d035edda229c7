"""Wire codec throughput beside safetensors and memcpy, measured in one run.

    python benchmarks/bench_codec.py --mb 64 --dtype bfloat16 --repeat 10 --json out.json

Every figure is payload bytes / median seconds of one encode + decode (GB/s,
1e9 bytes). Paths:

  memcpy            dst.copy_(src) into preallocated, touched tensors: the ceiling
  safetensors       safetensors.torch.save + load (what the codec replaces)
  wire_frames       encode + decode(frames): zero copy for tensors <= 1 MiB (one frame),
                    one copy into a fresh tensor for a tensor spanning frames
  wire_frames_pool  the same with decode(alloc=...) handing out a reused buffer
  wire_recv_pool    encode, copy every frame into a reused receive buffer (what a
                    recv_into transport does), decode that buffer in place: the
                    realistic transport-included figure, one memcpy in all
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections.abc import Callable

import safetensors.torch
import torch

from spec_serve.protocol.wire import MAX_FRAME_BYTES, decode, encode

DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float64", "bfloat16", "float16", "int64", "int32", "int16", "int8", "uint8", "bool")
}


def make_payload(total_bytes: int, dtype: torch.dtype, count: int) -> dict[str, torch.Tensor]:
    per = total_bytes // count // dtype.itemsize
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (count, per * dtype.itemsize), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw &= 1
    return {f"t{i}": raw[i].clone().view(dtype) for i in range(count)}


def timed(paths: dict[str, Callable[[], object]], repeat: int) -> dict[str, list[float]]:
    """Seconds per call of each path, round-robin so machine noise hits all alike."""
    for fn in paths.values():
        fn()  # warm up: first touch of the buffers a path keeps
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeat):
        for name, fn in paths.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:  # noqa: C901, PLR0915
    # A benchmark script: flags, then one timed scenario after another, read top to bottom.
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=64, help="payload size in MiB")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--tensors", type=int, default=1, help="split the payload into this many tensors")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--json", metavar="OUT", help="write the results here")
    args = parser.parse_args()

    tensors = make_payload(int(args.mb * (1 << 20)), DTYPES[args.dtype], args.tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())

    dsts = {k: torch.empty_like(t).fill_(0) for k, t in tensors.items()}
    frames = encode(tensors)
    total = sum(memoryview(f).nbytes for f in frames)
    recv = torch.zeros(total, dtype=torch.uint8)  # a pooled receive buffer, touched
    recv_view = memoryview(recv.numpy())
    pool = torch.zeros(nbytes, dtype=torch.uint8)  # a pooled decode buffer, touched

    def memcpy():
        for k, t in tensors.items():
            dsts[k].copy_(t)

    def st_round_trip():
        return safetensors.torch.load(safetensors.torch.save(tensors))

    def wire_frames():
        return decode(encode(tensors))

    def wire_frames_pool():
        used = 0

        def alloc(n):  # a bump allocator over the reused buffer
            nonlocal used
            used += n
            return pool[used - n : used]

        return decode(encode(tensors), alloc=alloc)

    def wire_recv_pool():
        pos = 0
        for frame in encode(tensors):
            n = memoryview(frame).nbytes
            if n:
                recv[pos : pos + n].copy_(torch.frombuffer(frame, dtype=torch.uint8))
            pos += n
        return decode([recv_view])

    paths = {
        "memcpy": memcpy,
        "safetensors": st_round_trip,
        "wire_frames": wire_frames,
        "wire_frames_pool": wire_frames_pool,
        "wire_recv_pool": wire_recv_pool,
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        for name in ("wire_frames", "wire_frames_pool", "wire_recv_pool"):
            got = paths[name]()
            assert all(torch.equal(got[k].view(torch.uint8), t.view(torch.uint8)) for k, t in tensors.items()), name
        results = timed(paths, args.repeat)

    rate = {name: nbytes / statistics.median(times) / 1e9 for name, times in results.items()}
    print(
        f"payload: {args.tensors} x {args.dtype} tensor(s), {nbytes / (1 << 20):.1f} MiB, "
        f"{len(frames)} frames (max {MAX_FRAME_BYTES >> 20} MiB), repeat {args.repeat}, torch {torch.__version__}"
    )
    print(f"{'path':<18}{'median ms':>10}{'best ms':>10}{'GB/s':>8}{'x safetensors':>15}{'x memcpy':>10}")
    for name, times in results.items():
        print(
            f"{name:<18}{statistics.median(times) * 1e3:>10.2f}{min(times) * 1e3:>10.2f}{rate[name]:>8.2f}"
            f"{rate[name] / rate['safetensors']:>15.1f}{rate[name] / rate['memcpy']:>10.2f}"
        )
    if args.json:
        report = {
            "payload": {"mb": args.mb, "dtype": args.dtype, "tensors": args.tensors, "bytes": nbytes},
            "frames": len(frames),
            "repeat": args.repeat,
            "torch": torch.__version__,
            "paths": {
                name: {
                    "median_s": statistics.median(times),
                    "best_s": min(times),
                    "gb_per_s": rate[name],
                    "x_safetensors": rate[name] / rate["safetensors"],
                    "x_memcpy": rate[name] / rate["memcpy"],
                }
                for name, times in results.items()
            },
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
