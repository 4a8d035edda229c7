"""Where a GPU client's time goes while it takes replies over frames: full EAGLE-3 compact on the wire, or DSpark.

The bench's remote_1w_auto (one worker on the client's GPU, the same-host plane off: frames, answered
compact, expanded on the client), with the client's CUDA work recorded by torch.profiler and summarised
as text: the top CUDA ops of the client process by device time, its device time per batch, and the
intervals between batch completions (the worker's pace as the client sees it). Each mode runs in turn
in one process, against one worker, so they are compared in one run:
  auto              compact="auto" (the default), frames landed through pinned slabs (staging.py)
  compact           compact=True, the same landing
  auto-pageable     compact="auto", frames copied straight to the device (pageable, as before staging.py)
  dspark            the DSpark kind (no expansion)
A mode may name its prefetch depth, ``auto@3`` (else ``--prefetch``). Every timed batch is checked bit for bit
against the colocated forward (expanded as the client does), by fingerprint as it is consumed (``Context.check``).
Besides the profile, each mode's stages per batch,
medians on the client's clock: from submission to the reply's arrival at the client's I/O thread (the worker's
queue, forward, device->host copy and the send), its landing on the device (staging, digest), and from landed
to resolved (the digest check, the expansion). The rows are the bench's workload (``--lengths``, lognormal by default).

    python benchmarks/profile_client.py --gpu-8b --devices cuda:0 --steps 8 --out prof
    python benchmarks/profile_client.py --gpu-8b --modes auto,compact,auto,compact --steps 24
    python benchmarks/profile_client.py --gpu-8b --modes auto@2,auto@3,dspark@2,dspark@3 --steps 24

``--out`` keeps a Chrome trace per mode (chrome://tracing or ui.perfetto.dev).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from spec_serve.client import api as client_api  # noqa: E402
from spec_serve.client import assembly  # noqa: E402
from spec_serve.tools.bench import Context, _sync, make_config  # noqa: E402
from spec_serve.tools.verify import fingerprint  # noqa: E402

TOP_OPS = 15


# mode -> (compact, frames through the staging slabs, kind)
MODES = {"auto": ("auto", True, "eagle3"), "compact": (True, True, "eagle3"),
         "auto-pageable": ("auto", False, "eagle3"), "dspark": (False, True, "dspark")}


@contextlib.contextmanager
def _stage_clock(stages: list[dict[str, float]]):
    """Record, for each batch assembled meanwhile (in submission order), when its reply reached the client's
    I/O thread (``arrived``) and when its tensors had landed on the device (``landed``): a profiling aid
    around ``assembly._Batch``."""
    init, accept, land = assembly._Batch.__init__, assembly._Batch._accept, assembly._Batch._land

    def timed_init(batch, *args, **kwargs):
        init(batch, *args, **kwargs)
        batch.stage = {}
        stages.append(batch.stage)

    def timed_accept(batch, k, reply):
        batch.stage.setdefault("arrived", time.perf_counter())
        return accept(batch, k, reply)

    def timed_land(batch, *args):
        landed = land(batch, *args)
        batch.stage["landed"] = time.perf_counter()
        return landed

    assembly._Batch.__init__ = timed_init  # type: ignore[method-assign]
    assembly._Batch._accept, assembly._Batch._land = timed_accept, timed_land  # type: ignore[method-assign]
    try:
        yield
    finally:
        assembly._Batch.__init__ = init  # type: ignore[method-assign]
        assembly._Batch._accept, assembly._Batch._land = accept, land  # type: ignore[method-assign]


def _stage_ms(stages: list[dict[str, float]]) -> dict[str, float]:
    """Medians over batches of each stage, in ms: the reply's way to the client, its landing, and what follows
    until the batch resolves (the digest check, the expansion)."""
    spans = {"reply": ("submitted", "arrived"), "landing": ("arrived", "landed"),
             "check_and_expansion": ("landed", "resolved")}
    return {name: round(statistics.median((s[b] - s[a]) * 1e3 for s in stages), 1) for name, (a, b) in spans.items()}


def _timed(client, batches: list, kind: str, prefetch: int) -> tuple[float, list[dict[str, float]], list]:
    """``batches`` back to back at ``prefetch``, each taken in order as a trainer does: the seconds, each batch's
    stage times, and its fingerprint (no batch is kept)."""
    stages: list[dict[str, float]] = []
    prints = []
    in_flight: collections.deque = collections.deque()

    def take() -> None:
        future, stage = in_flight.popleft()
        prints.append(fingerprint(future.result()))
        stage.setdefault("resolved", time.perf_counter())  # result() may return before the callback ran

    with _stage_clock(stages):
        start = time.perf_counter()
        for b in batches:  # submitting blocks at prefetch depth
            future = client.generate_batch_async(*b, kind=kind)
            stage = stages[-1]
            stage["submitted"] = time.perf_counter()
            future.add_done_callback(lambda _, s=stage: s.setdefault("resolved", time.perf_counter()))
            in_flight.append((future, stage))
            if len(in_flight) > prefetch:
                take()
        while in_flight:
            take()
        _sync(client.device)
        return time.perf_counter() - start, stages, prints


def _run(ctx: Context, batches: list, mode: str, prefetch: int, trace: Path | None) -> dict:
    """Tokens/s of ``batches`` back to back at ``prefetch``, then the same batches profiled."""
    compact, staged, kind = MODES[mode]
    cuda = ctx.device.type == "cuda"
    if not staged:  # profiling aid only: the client lands frames as it did before staging.py
        original, client_api.Staging = client_api.Staging, lambda device: None  # type: ignore[assignment]
    try:
        with client_api.RemoteTargetModel(ctx.frontend, service="w1", device=ctx.device, timeout=600,
                                          prefetch_depth=prefetch, same_host_plane=False,
                                          compact=compact) as client:
            client.set_vocab_mapping(*ctx.mapping)
            client.generate_batch(*batches[0], kind=kind)  # warm: the lm_head slice, the allocator, the slabs
            seconds, stages, prints = _timed(client, batches, kind, prefetch)
            with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] * cuda)]) as prof:
                for f in [client.generate_batch_async(*b, kind=kind) for b in batches]:
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
    verified = sum(ctx.check(i, got, compact=compact is not False, device=ctx.device, kind=kind)
                   for i, got in enumerate(prints))
    ends = [s["resolved"] for s in stages]
    gaps = [round((b - a) * 1e3, 1) for a, b in zip(ends, ends[1:])]
    return {"tok_s": tokens / seconds, "verified": f"{verified}/{len(batches)}", "prof": prof, "replies": landed,
            "slabs": slabs, "gaps_ms": gaps, "stages_ms": _stage_ms(stages)}


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
             f"   ms a batch, medians: {result['stages_ms']}",
             f"   client {'device' if cuda else 'CPU'} time: {total / 1e3 / batches:.1f} ms a batch "
             f"({total / 1e3:.1f} ms over {batches})",
             f"   {'op':<64} {'ms/batch':>9} {'calls':>7}"]
    for e in rows[:TOP_OPS]:
        lines.append(f"   {e.key[:64]:<64} {_own_us(e, cuda) / 1e3 / batches:>9.2f} {e.count:>7}")
    return "\n".join(lines)


def _mode(spec: str, prefetch: int) -> tuple[str, int]:
    """``NAME`` or ``NAME@PREFETCH``."""
    name, _, depth = spec.partition("@")
    return name, int(depth) if depth else prefetch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu-8b", action="store_true", help="the Llama-3.1-8B shape, random weights, bf16")
    parser.add_argument("--devices", default="cuda:0")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prefetch", type=int, default=2, help="batches in flight, unless a mode names its own")
    parser.add_argument("--lengths", default="lognormal", help="row lengths, as spec-serve bench --lengths")
    parser.add_argument("--out", type=Path, default=None, help="folder for the Chrome traces")
    parser.add_argument("--modes", default="auto,compact,auto-pageable",
                        help=f"comma-separated, in order (repeats allowed), NAME or NAME@PREFETCH: {', '.join(MODES)}")
    args = parser.parse_args()
    modes = [_mode(m.strip(), args.prefetch) for m in args.modes.split(",") if m.strip()]
    unknown = sorted({name for name, _ in modes} - MODES.keys())
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    cfg = make_config(target=None, gpu_8b=args.gpu_8b, devices=args.devices, dtype=None, batch=None, seq=None,
                      steps=args.steps, warmup=1, prefetch=args.prefetch, draft_vocab=None, small_ranks=1,
                      small_requests=1, small_seq=None, max_batch_tokens=None, transport_messages=1,
                      only="remote_1w_auto", log_dir=None, lengths=args.lengths)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="spec-serve-profile-") as tmp:
        ctx = Context(cfg, tmp)
        try:
            ctx.start_cluster({"w1"})
            batches = ctx.batches[: cfg.steps]
            for i, (mode, prefetch) in enumerate(modes):
                trace = args.out / f"client-{i}-{mode}-{prefetch}.json" if args.out else None
                result = _run(ctx, batches, mode, prefetch, trace)
                print(_summary(f"{mode}@{prefetch}", result, len(batches), ctx.device.type == "cuda"), flush=True)
        finally:
            ctx.close()

if __name__ == "__main__":
    main()
