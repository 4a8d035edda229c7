"""Remote scenarios: batches through the broker to workers, consumed as a trainer does, each verified against the
colocated forward."""

from __future__ import annotations

import collections
import functools
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from spec_serve.tools.bench.batches import _nbytes, _sync, _tokens, make_batch
from spec_serve.tools.bench.checks import _figure, verified, verify_packed

if TYPE_CHECKING:
    from spec_serve.tools.bench.context import Context


def _mark_done(done_at: dict[int, float], i: int, _future: Any) -> None:
    done_at.setdefault(i, time.perf_counter())


def run_remote(ctx: Context, service: str, compact: bool | str, shards: int, name: str, nccl: bool = False,
               own_device: bool = False, packed: bool = False, plane: bool = False,
               dspark: bool = False, compiled: bool = False) -> dict[str, Any]:
    """Steady-state throughput: batches are submitted back to back (prefetch keeps ``prefetch`` in
    flight) and consumed in order as a trainer does, and the clock runs from the completion of the last
    warm-up batch to that of the last batch, so the figure excludes filling and draining the pipeline, as
    a long training run would. Every timed batch is verified once the clock has stopped: bit for bit against
    the colocated forward of the same input (by fingerprint, ``Context.check``: no batch is kept, so a run
    of any length fits the device), or (``packed``: the service's worker packs) within packing.TOLERANCE.
    ``plane``: replies through the same-host plane, else frames; ``dspark``: the DSpark kind; ``compiled``: the
    service's worker compiles its layers (within compiled.TOLERANCE, bit-equality to the colocated compiled
    forward counted); ``compact``: True, False or "auto" (the client's default: over frames the worker
    answers compact, so it is verified as compact, and how many batches also equal the full forward bit for
    bit is reported). ``landing`` counts what the client's landing path did over the run (``_landing``)."""
    from spec_serve.client.api import RemoteTargetModel

    # The client sits on the last device when asked to (a trainer has a GPU of its own) and for
    # NCCL, where it must: two ranks of one NCCL group cannot share a GPU.
    device = torch.device(ctx.cfg.devices[-1]) if nccl or own_device else ctx.device
    warmup = max(ctx.cfg.warmup, 1)
    batches = ctx.batches[: warmup + ctx.cfg.steps]
    kind = "dspark" if dspark else "eagle3"
    # wire_dtype pinned to the model dtype: every batch is checked bit for bit against the colocated forward
    # (an SPEC_SERVE_WIRE_DTYPE=fp8 in the environment would make each one differ by FP8's rounding).
    with RemoteTargetModel(ctx.frontend, service=service, device=device, prefetch_depth=ctx.cfg.prefetch,
                           num_shards=shards, compact=compact, timeout=600, enable_nccl=nccl,
                           same_host_plane=plane, wire_dtype="auto") as client:
        client.set_vocab_mapping(*ctx.mapping)
        before = _landing(client, device)
        # Compared within a tolerance after the clock: kept whole (short runs); else fingerprinted as consumed.
        seconds, nbytes, outputs = _consume(client, batches, kind, warmup, ctx.cfg.prefetch, keep=packed or compiled)
        _sync(device)
        landing = {k: v - before.get(k, 0) for k, v in _landing(client, device).items()}
        stats = client.stats
    tokens, padded = _tokens(batches[warmup:])
    compact_wire = compact is True or compact == "auto" and not (plane or nccl)  # what auto sends here
    wire_kind = "dspark" if dspark else "eagle3_compact" if compact_wire else "eagle3"
    if compiled:
        checked = ctx.verify_compiled(batches[warmup:], outputs, remote=not packed)
    elif packed:
        checked = verify_packed(ctx.engine(), batches[warmup:], outputs, ctx.mapping[1] if compact_wire else None,
                                flip_bounds=ctx.flip_bounds)
    else:
        timed = list(zip(range(warmup, len(batches)), outputs))
        checked = verified(sum(ctx.check(i, got, shards=shards, compact=compact_wire, device=device, kind=kind)
                               for i, got in timed), len(timed))
        if compact == "auto" and compact_wire and not dspark:
            checked["equal_to_full"] = sum(ctx.check(i, got, shards=shards, quiet=True) for i, got in timed)
    extra = {"wire_bytes_per_token": ctx.reply_bytes_per_token[wire_kind]} if not dspark else {}
    return _figure(name, tokens, nbytes, seconds, padded, **extra, retried=stats.retried,
                   nccl_batches=stats.nccl_batches, nccl_fallbacks=stats.nccl_fallbacks,
                   plane_replies=stats.plane_replies, plane_fallbacks=stats.plane_fallbacks, batched=stats.batched,
                   compact_replies=stats.compact_replies, lm_head_slices=stats.lm_head_slices, landing=landing,
                   **checked)


def _consume(client, batches: list, kind: str, warmup: int, prefetch: int, keep: bool) -> tuple[float, int, list]:
    """Submit ``batches`` back to back and take each answer in order once ``prefetch`` later ones are in flight,
    as a training loop does. Returns the seconds from the last warm-up answer to the last answer, the timed
    answers' bytes, and the timed answers (``keep``) or their fingerprints (``verify.fingerprint``)."""
    from spec_serve.tools.verify import fingerprint

    done_at: dict[int, float] = {}
    in_flight: collections.deque = collections.deque()
    nbytes, timed = 0, []

    def take(i: int, future) -> None:
        nonlocal nbytes
        out = future.result()
        _mark_done(done_at, i, future)  # result() may return before the done callback has run
        if i >= warmup:
            nbytes += _nbytes(out)
            timed.append(out if keep else fingerprint(out))

    for i, b in enumerate(batches):
        future = client.generate_batch_async(*b, kind=kind)
        future.add_done_callback(functools.partial(_mark_done, done_at, i))
        in_flight.append((i, future))
        if len(in_flight) > prefetch:
            take(*in_flight.popleft())
    while in_flight:
        take(*in_flight.popleft())
    return done_at[len(batches) - 1] - done_at[warmup - 1], nbytes, timed


def _landing(client, device: torch.device) -> dict[str, int]:
    """Counters of what landing replies cost the client, for a run's deltas: pinned slabs made and waits for
    a slab's copy (staging.py), receive buffers allocated (CPU), device memory the caching allocator had to
    ask the driver for (cudaMalloc) and allocations retried after freeing its cache (both stall the device)."""
    staging = client._staging  # read for its counters only
    counts = {"staging_slabs": staging.allocations if staging else 0, "staging_waits": staging.waits if staging else 0,
              "receive_buffers": client._io.recv_alloc.allocations}
    if device.type == "cuda":
        memory = torch.cuda.memory_stats(device)
        counts.update(device_mallocs=int(memory.get("num_device_alloc", 0)),
                      alloc_retries=int(memory.get("num_alloc_retries", 0)))
    return counts


def run_small(ctx: Context, service: str, name: str) -> dict[str, Any]:
    """Several ranks at once, each with small requests in flight: what batching is for. Every request is
    verified after the clock against the colocated forward of it alone: bit for bit, or within
    packing.TOLERANCE where the worker packs (small_batched)."""
    from spec_serve.client.api import RemoteTargetModel

    cfg = ctx.cfg
    vocab = ctx.info["vocab_size"]
    clients = [RemoteTargetModel(ctx.frontend, service=service, device=ctx.device, prefetch_depth=4,
                                 timeout=600, same_host_plane=False, compact=False, wire_dtype="auto")
               for _ in range(cfg.small_ranks)]
    try:
        for c in clients:
            c.set_vocab_mapping(*ctx.mapping)
        batched = [0]
        barrier = threading.Barrier(cfg.small_ranks + 1)
        timed: list[tuple[tuple, dict]] = []  # (request, result), verified once the clock stopped

        def rank(r: int, client) -> None:
            reqs = [make_batch(1, cfg.small_seq, vocab, seed=1000 * r + i) for i in range(cfg.small_requests)]
            client.generate_batch(*reqs[0], kind="eagle3")  # warm-up
            barrier.wait()
            futures = [client.generate_batch_async(*b, kind="eagle3") for b in reqs]
            timed.extend(zip(reqs, [f.result() for f in futures]))

        threads = [threading.Thread(target=rank, args=(r, c)) for r, c in enumerate(clients)]
        for t in threads:
            t.start()
        barrier.wait()
        start = time.perf_counter()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - start
        batched[0] = sum(c.stats.batched for c in clients)
    finally:
        for c in clients:
            c.close()
    tokens = cfg.small_ranks * cfg.small_requests * cfg.small_seq
    requests = cfg.small_ranks * cfg.small_requests
    if service == "batch":  # a packing worker
        checked = verify_packed(ctx.engine(), [b for b, _ in timed], [out for _, out in timed],
                                flip_bounds=ctx.flip_bounds)
        checked = {**checked, "verified": f"{checked['verified'].split('/')[0]}/{requests}"}
    else:
        checked = {"verified": f"{sum(ctx.verify(b, out) for b, out in timed)}/{requests}"}
    if checked["verified"] != f"{requests}/{requests}":
        checked["status"] = "INVALID"
    return _figure(name, tokens, tokens * ctx.reply_bytes_per_token["eagle3"], seconds,
                   requests=requests, batched_replies=batched[0], **checked)
