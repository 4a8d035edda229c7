"""Where a GPU client's device time goes while it takes full EAGLE-3 over frames, compact on the wire.

The bench's remote_1w_auto (one worker on the client's GPU, the same-host plane off: frames, answered
compact, expanded on the client), with the client's CUDA work recorded by torch.profiler and summarised
as text: the top CUDA ops of the client process by device time, its device time per batch, and the
intervals between batch completions (the worker's pace as the client sees it). Each mode runs in turn
in one process, against one worker, so they are compared in one run:
  auto              compact="auto" (the default), frames landed through pinned slabs (staging.py)
  compact           compact=True, the same landing
  auto-pageable     compact="auto", frames copied straight to the device (pageable, as before staging.py)
Every timed batch is checked bit for bit against the colocated forward, expanded as the client does.

    python benchmarks/profile_client.py --gpu-8b --devices cuda:0 --steps 8 --out prof
    python benchmarks/profile_client.py --gpu-8b --modes auto,compact,auto,compact --steps 24

``--out`` keeps a Chrome trace per mode (chrome://tracing or ui.perfetto.dev).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from spec_serve.client import api as client_api  # noqa: E402
from spec_serve.tools.bench import Context, _sync, make_config  # noqa: E402

TOP_OPS = 15


MODES = {"auto": ("auto", True), "compact": (True, True), "auto-pageable": ("auto", False)}


def _run(ctx: Context, batches: list, compact: bool | str, staged: bool, trace: Path | None) -> dict:
    """Tokens/s of ``batches`` back to back (prefetch as the bench), then the same batches profiled."""
    cuda = ctx.device.type == "cuda"
    if not staged:  # profiling aid only: the client lands frames as it did before staging.py
        original, client_api.Staging = client_api.Staging, lambda device: None  # type: ignore[assignment]
    try:
        with client_api.RemoteTargetModel(ctx.frontend, service="w1", device=ctx.device, timeout=600,
                                          prefetch_depth=ctx.cfg.prefetch, same_host_plane=False,
                                          compact=compact) as client:
            client.set_vocab_mapping(*ctx.mapping)
            client.generate_batch(*batches[0])  # warm: the lm_head slice, the allocator, the slabs
            start = time.perf_counter()
            done: dict[int, float] = {}  # batch -> when its future resolved (submitting blocks at prefetch depth)
            futures = []
            for i, b in enumerate(batches):
                futures.append(client.generate_batch_async(*b))
                futures[-1].add_done_callback(lambda _, i=i: done.setdefault(i, time.perf_counter()))
            outputs = []
            for i, f in enumerate(futures):
                outputs.append(f.result())
                done.setdefault(i, time.perf_counter())  # result() may return before the callback ran
            _sync(ctx.device)
            seconds = time.perf_counter() - start
            with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] * cuda)]) as prof:
                for f in [client.generate_batch_async(*b) for b in batches]:
                    f.result()
                _sync(ctx.device)
            landed = dict(client.stats.replies)
            staging = client._staging  # read here for its counters only
            slabs = staging and {"pinned": staging.allocations, "copies": staging.copies, "waits": staging.waits}
    finally:
        if not staged:
            client_api.Staging = original  # type: ignore[assignment]
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    tokens = sum(int(b[1].sum()) for b in batches)
    verified = sum(ctx.verify(b, out, compact=True, device=ctx.device) for b, out in zip(batches, outputs))
    ends = [done[i] for i in sorted(done)]
    gaps = [round((b - a) * 1e3, 1) for a, b in zip(ends, ends[1:])]
    return {"tok_s": tokens / seconds, "verified": f"{verified}/{len(batches)}", "prof": prof, "replies": landed,
            "slabs": slabs, "gaps_ms": gaps}


def _own_us(event, cuda: bool) -> float:
    """Time of a GPU activity (kernel, memcpy, memset) of the client; a CPU client: an op's own CPU time (the
    smoke run without a GPU). CPU ops also carry their kernels' device time: counted once, as the kernels."""
    if not cuda:
        return float(event.self_cpu_time_total)
    if event.device_type != DeviceType.CUDA:
        return 0.0
    return float(getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0))


def _summary(name: str, result: dict, batches: int, cuda: bool) -> str:
    rows = [e for e in result["prof"].key_averages() if _own_us(e, cuda) > 0]
    rows.sort(key=lambda e: _own_us(e, cuda), reverse=True)
    total = sum(_own_us(e, cuda) for e in rows)
    lines = [f"== {name}: {result['tok_s']:,.0f} tok/s, verified {result['verified']}, replies {result['replies']}, "
             f"slabs {result['slabs']}",
             f"   ms between batch completions: {result['gaps_ms']}",
             f"   client {'device' if cuda else 'CPU'} time: {total / 1e3 / batches:.1f} ms a batch "
             f"({total / 1e3:.1f} ms over {batches})",
             f"   {'op':<64} {'ms/batch':>9} {'calls':>7}"]
    for e in rows[:TOP_OPS]:
        lines.append(f"   {e.key[:64]:<64} {_own_us(e, cuda) / 1e3 / batches:>9.2f} {e.count:>7}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu-8b", action="store_true", help="the Llama-3.1-8B shape, random weights, bf16")
    parser.add_argument("--devices", default="cuda:0")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None, help="folder for the Chrome traces")
    parser.add_argument("--modes", default="auto,compact,auto-pageable",
                        help=f"comma-separated, in order (repeats allowed): {', '.join(MODES)}")
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - MODES.keys())
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    cfg = make_config(target=None, gpu_8b=args.gpu_8b, devices=args.devices, dtype=None, batch=None, seq=None,
                      steps=args.steps, warmup=1, prefetch=2, draft_vocab=None, small_ranks=1, small_requests=1,
                      small_seq=None, max_batch_tokens=None, transport_messages=1, only="remote_1w_auto", log_dir=None)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="spec-serve-profile-") as tmp:
        ctx = Context(cfg, tmp)
        try:
            ctx.start_cluster({"w1"})
            batches = ctx.batches[: cfg.steps]
            for i, mode in enumerate(modes):
                compact, staged = MODES[mode]
                trace = args.out / f"client-{i}-{mode}.json" if args.out else None
                result = _run(ctx, batches, compact, staged, trace)
                print(_summary(mode, result, len(batches), ctx.device.type == "cuda"), flush=True)
        finally:
            ctx.close()


if __name__ == "__main__":
    main()
