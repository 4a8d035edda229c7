"""``spec-serve bench``: remote supervision against the target's own forward, measured in one run.

Every figure of a run is measured side by side on the same machine, so the ratios mean something
even on a shared, noisy box (absolute numbers do not travel). Scenarios (``--only`` picks some):

  colocated           HFTarget.generate_batch in this process (forward + supervision on the device)
  colocated_compact   the compact kind + expand_compact on the same device (what the client does)
  colocated_dspark    the DSpark kind
  remote_1w           through the broker, one worker, prefetch_depth 2, EAGLE-3 full, replies as
                      frames (the same-host plane off: what a client on another host gets)
  remote_1w_compact   the same with RemoteTargetModel(compact=True)
  remote_1w_auto      the same with the client's defaults (compact="auto"): over frames the worker answers
                      compact and the client expands on its device; verified against the colocated compact
                      batch expanded, and ``equal_to_full`` counts the batches bit-equal to the full forward
  remote_1w_dspark    the same, DSpark
  samehost_1w         one worker, replies through the same-host plane (CUDA IPC between GPUs, shared
                      memory otherwise); verified like every remote scenario
  samehost_1w_compact, samehost_1w_dspark, samehost_2w, samehost_2w_compact   likewise
  samehost_1w_own_gpu the client on the last device (two GPUs: peer copies from the worker's GPU)
  remote_1w*_own_gpu  the same two with the client on the last device (a trainer's own GPU)
  remote_2w           two workers, each batch sharded in two (num_shards=2)
  remote_2w_compact
  colocated_packed    HFTarget.generate_packed on each batch in this process: the padding dropped,
                      rows packed into one sequence (docs/packing.md); every timed batch verified
                      against the colocated padded forward within packing.TOLERANCE (verified=N/N)
  remote_1w_packed    through the broker to one worker started with --packing (queued requests may
                      share a packed forward); every timed batch verified the same way
  remote_1w_compact_packed   the same with RemoteTargetModel(compact=True), verified against the
                      colocated compact forward expanded the same way
  samehost_1w_packed, samehost_1w_compact_packed   the packing worker through the same-host plane
  samehost_1w_packed_own_gpu, remote_1w_compact_packed_own_gpu   the client on the last device
  colocated_compiled  HFTarget(compile=True) in this process (decoder layers compiled, docs/compile.md);
                      every timed batch verified against the colocated eager forward within
                      compiled.TOLERANCE
  colocated_packed_compiled   generate_packed on the compiled engine, verified the same way
  samehost_1w_compiled        a worker started with --compile, through the same-host plane: every
                      batch within compiled.TOLERANCE of the colocated eager forward, and counted bit-equal
                      to the colocated compiled forward (bit_equal_compiled=N/M; not a packing worker's,
                      whose queued requests share packed forwards)
  samehost_1w_packed_compiled a worker started with --packing --compile, the same way
  compile_cold        seconds a fresh process takes to compile the target's layers (HFTarget(compile=True)
                      with an empty Inductor cache, every class as a packing worker compiles), then
                      compile_warm: a second process on that cache, as a worker without --packing loads
                      (no packed class: the classes the cold one saved load whole, nothing traced),
                      compile_warm_packing: the same as a packing worker loads, compile_warm_unsaved: that
                      with the saved classes and manifests deleted (Inductor's kernel cache alone), and
                      compile_artifacts: a process with an empty cache that first loads the cache artifacts
                      the cold one saved (torch.compiler.save/load_cache_artifacts; that load is counted in
                      its seconds). Each figure splits its seconds: per batch class, and the phases
                      (trace, backend, guards, load, other); device_seconds is the eager forward before compiling
  small_unbatched     many small requests from several ranks, one worker without packing
  small_batched       the same against a worker started with --packing --max-batch-tokens, so
                      queued requests share a packed forward (within packing.TOLERANCE, not bit-equal)
  broker_null         transport only: a worker whose engine returns ready tensors of the EAGLE-3
                      reply size, through the broker (request via broker, reply straight back)
  broker_null_compact the same with compact EAGLE-3 replies (what compact="auto" sends across hosts), landed,
                      not expanded (tools/null_engine.py: the 8B reply shape either way)
  samehost_null       the same bytes lent through the same-host plane
  direct_null         the same bytes from a plain ROUTER socket answering a DEALER (no broker)
  zmq_raw             raw ZeroMQ PUSH->PULL over loopback: pre-built 16 MiB frames, same bytes
  frames              the codec path over the same socket pair: wire.encode -> send -> wire.decode
  zmq_raw_ipc, frames_ipc   the same two over ipc:// (unix sockets)
  worker_pool         the worker's hot path in-process (serve, host copy into the pinned pool,
                      encode): pool allocations against messages (flat = no fresh host memory)
  remote_nccl         a client bound to its own worker (enable_nccl=True): metadata over ZeroMQ,
                      tensors over a private NCCL pair group (gloo on CPU); worker on the first
                      device, client on the last
  remote_nccl_compact the same, compact EAGLE-3

Remote scenarios report steady-state throughput: batches go back to back with ``prefetch`` in
flight, timed from the completion of the last warm-up batch to that of the last batch (a training
run of thousands of steps never drains the pipeline; an 8-batch run that counted the drain would
charge one reply transfer, about 5%, to every figure). ``--repeat N`` runs N rounds in alternating
order and reports medians of per-round ratios.

Row lengths (``--lengths``): ``lognormal`` (default: training rows vary, and each batch is padded to its
longest) draws each row's length from a log-normal distribution with median ``0.293 * seq`` (600 tokens at
``--seq 2048``) and sigma 0.8, rounded and clipped to ``[2, seq]``, seeded per batch; ``full`` fills every
row to ``--seq`` (a figure measured only on full rows is no claim about training); or ``PATH.jsonl`` replays a
dataset's lengths: one JSON object a line, ``{"length": N}`` or ``{"input_ids": [...]}`` (its length
counts), truncated to ``--seq``, rows drawn uniformly with replacement (seeded). Either way each batch
is right-padded to its longest row, as a trainer's collator pads: with 4 rows, log-normal batches are
about 58% real tokens. Figures report useful (non-pad) tokens/s, which the ratios compare, next to
padded tokens/s (rows x padded length).

Every remote scenario verifies what it timed: each timed batch is compared bit for bit with the colocated
forward of the same input, computed as the client received it (``spec_serve.tools.verify``: per shard;
compact against colocated compact, expanded on the client's device); a packing worker's replies within
``packing.TOLERANCE`` instead (``verify_packed``). Each scenario consumes its batches in order as a trainer
does, so at most ``prefetch + 1`` are held whatever ``--steps``: a bit-equal check takes the batch's
fingerprint as it is consumed (``verify.fingerprint``: two 32-bit sums of its words, a few milliseconds of
device work a batch on both sides, colocated ones too), compared after the clock with the fingerprint of the
colocated scenario's answer to the same batch (or of the colocated forward computed then, once for every
round). Packed and compiled answers, compared within a tolerance, are kept whole instead.
Figures show ``verified=N/M``; a ratio with a wrong batch on either side prints INVALID instead of
its value, and a remote/colocated ratio above 1.10 is flagged IMPLAUSIBLE (remote runs the same
forward plus transport). On CPU the colocated forward runs with the math threads one worker gets
(``worker_threads``).

Also reported: bytes per token of the full and compact EAGLE-3 replies, measured on the target and
computed analytically at the Llama-3.1-8B shape.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from spec_serve.engines.compiled import CompileReport
    from spec_serve.tools.launch import Cluster

# Llama-3.1-8B's shape (the GPU benchmark builds it with random bf16 weights on the device).
LLAMA_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}
LLAMA_8B_AUX_LAYERS = "1,15,28"


@dataclasses.dataclass
class BenchConfig:
    target: str | None = None  # model dir; None: the tiny target (or the 8B shape with gpu_8b)
    gpu_8b: bool = False
    devices: tuple[str, ...] = ("cpu",)  # worker devices; the first is also the colocated/client device
    dtype: str | None = None
    batch: int = 4
    seq: int = 256
    steps: int = 8
    warmup: int = 2
    prefetch: int = 2
    draft_vocab: int = 256
    small_ranks: int = 4
    small_requests: int = 12  # per rank
    small_seq: int = 64
    max_batch_tokens: int = 4096
    transport_messages: int = 8
    transport_seq: int = 256  # transport scenarios send 1 x this many tokens of 8B-shaped EAGLE-3 replies
    only: tuple[str, ...] = ()
    log_dir: str | None = None
    repeat: int = 1  # rounds over the scenarios, alternating their order; figures are per-round medians
    lengths: str = "lognormal"  # row lengths: "lognormal", "full" or a JSONL file (see the module doc)


def bytes_per_token(hidden: int, draft_vocab: int, dtype_bytes: int = 2, mask_bytes: int = 8) -> dict[str, int]:
    """Reply bytes a token: full EAGLE-3 (aux, probs f32, mask, ids, loss) and compact (aux, last, argmax, ids,
    loss)."""
    common = 3 * hidden * dtype_bytes + 8 + mask_bytes  # aux + input_ids int64 + loss_mask as sent
    return {"eagle3": common + draft_vocab * 4 + 1, "eagle3_compact": common + hidden * dtype_bytes + 4}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_batch(batch: int, seq: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full-length rows (every token counts), random ids, loss on the last three quarters."""
    return padded_batch([seq] * batch, vocab, seed)


# The log-normal workload: median LOGNORMAL_MEDIAN_SHARE * seq, spread LOGNORMAL_SIGMA (ln units). At
# seq 2048: median 600, 6% of rows at the cap, about 55% of a 4-row batch real tokens (issue 16).
LOGNORMAL_MEDIAN_SHARE = 600 / 2048
LOGNORMAL_SIGMA = 0.8


def row_lengths(spec: str, batches: int, rows: int, seq: int) -> list[list[int]]:
    """Each batch's row lengths for the ``--lengths`` spec (see the module doc); batch ``i`` uses seed ``i``."""
    if spec == "full":
        return [[seq] * rows for _ in range(batches)]
    if spec == "lognormal":
        median = math.log(LOGNORMAL_MEDIAN_SHARE * seq)
        draws = [torch.randn(rows, generator=torch.Generator().manual_seed(i)) for i in range(batches)]
        return [[min(seq, max(2, round(math.exp(median + LOGNORMAL_SIGMA * float(z))))) for z in d] for d in draws]
    pool = _jsonl_lengths(Path(spec))
    picks = [torch.randint(len(pool), (rows,), generator=torch.Generator().manual_seed(i)) for i in range(batches)]
    return [[min(seq, max(2, pool[int(j)])) for j in p] for p in picks]


def _jsonl_lengths(path: Path) -> list[int]:
    if not path.is_file():
        raise ValueError(f"--lengths {path}: not 'full', 'lognormal' or an existing JSONL file")
    lengths = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            n = int(row["length"]) if "length" in row else len(row["input_ids"])
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path}:{number}: expected {{\"length\": N}} or {{\"input_ids\": [...]}}") from None
        lengths.append(n)
    if not lengths:
        raise ValueError(f"{path}: no rows")
    return lengths


def padded_batch(lengths: list[int], vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of these lengths, right-padded (pad id 0) to the longest; random ids, loss on each row's last
    three quarters. All lengths equal to ``seq``: the same batch as ``make_batch``."""
    gen = torch.Generator().manual_seed(seed)
    batch, seq = len(lengths), max(lengths)
    positions = torch.arange(seq)[None, :]
    n = torch.tensor(lengths)[:, None]
    attn = (positions < n).to(torch.int64)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen) * attn
    loss = attn * (positions >= n // 4)
    return ids, attn, loss


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _figure(name: str, tokens: int, nbytes: int, seconds: float, padded_tokens: int | None = None,
            **extra) -> dict[str, Any]:
    """One scenario's figure: ``tokens`` are useful (real) tokens; ``padded_tokens`` what the padded
    batches held (rows x padded length), where the scenario ran training batches."""
    figure = {"scenario": name, "tokens": tokens, "bytes": nbytes, "seconds": round(seconds, 6),
              "tokens_per_s": round(tokens / seconds, 1) if seconds else None,
              "gb_per_s": round(nbytes / seconds / 1e9, 4) if seconds else None}
    if padded_tokens is not None:
        figure.update(padded_tokens=padded_tokens,
                      padded_tokens_per_s=round(padded_tokens / seconds, 1) if seconds else None)
    return {**figure, **extra}


def _tokens(batches) -> tuple[int, int]:
    """(real, padded) tokens of host batches (counted on the host: no device sync in a timed loop)."""
    return sum(int(b[1].sum()) for b in batches), sum(b[1].numel() for b in batches)


def verify_packed(engine, batches, outputs, compact_mask: torch.Tensor | None = None,
                  flip_bounds: Callable[[tuple, dict | None], dict[str, float]] | None = None) -> dict[str, Any]:
    """Each packed or compiled answer against the colocated padded eager forward of its batch
    (``packing.compare``; ``compiled.TOLERANCE`` is the same table), its flips against the bound derived for
    that batch (``engines.flips``: what a deviation at the tolerance's hidden rel_norm flips on these rows).

    ``compact_mask``: the outputs are compact replies expanded by a client (``selected_token_mask``
    given), so the reference is the colocated compact forward expanded the same way; else the
    colocated EAGLE-3 forward. ``flip_bounds(batch, eagle3_reference_or_None)``: a batch's flip bound
    (``Context.flip_bounds`` keeps them over rounds; computed here if not given). Returns ``verified`` "N/M"
    (M batches, N within the tolerance for the model's dtype), the tolerance, the worst value of each measure
    over all batches, the lowest flip bound, and ``status: INVALID`` unless N == M.
    """
    from spec_serve.engines import packing

    tolerance = packing.TOLERANCE[engine.model.dtype]
    bound_of = flip_bounds or functools.partial(_flip_bounds, engine)
    worst: dict[str, float] = {}
    lowest: dict[str, float] = {}
    passed, failures = 0, []
    for b, out in zip(batches, outputs):
        want = _padded_reference(engine, b, compact_mask)
        bounds = bound_of(b, want if compact_mask is None else None)
        report = packing.compare(out, want, b[1].to(engine.device))
        for name, measures in report.items():
            for measure, value in measures.items():
                worst[f"{name}.{measure}"] = max(worst.get(f"{name}.{measure}", 0.0), value)
        lowest = {name: min(lowest.get(name, bound), bound) for name, bound in bounds.items()}
        bad = packing.violations(report, tolerance, bounds)
        passed += not bad
        failures += bad[:1]
    result = {"verified": f"{passed}/{len(outputs)}",
              "tolerance": {**dataclasses.asdict(tolerance), "flip_rate": "derived per batch (flip_bound)"},
              "worst": {k: float(f"{v:.3g}") for k, v in sorted(worst.items())},
              "flip_bound": {k: float(f"{v:.3g}") for k, v in sorted(lowest.items())}}
    if passed != len(outputs) or not outputs:
        result.update(status="INVALID", first_failures=failures[:3])
    return result


def _padded_reference(engine, batch, compact_mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The colocated padded eager forward of ``batch``: EAGLE-3, or (``compact_mask``) compact expanded."""
    from spec_serve.supervision.eagle3 import expand_compact, lm_head_slice

    if compact_mask is None:
        return engine.generate_batch(*batch, kind="eagle3")
    weight = lm_head_slice(engine.get_output_embeddings().weight, engine.vocab_mapping()[0])
    return expand_compact(engine.generate_batch(*batch, kind="eagle3_compact"), weight,
                          compact_mask.to(engine.device))


def _flip_bounds(engine, batch, reference: dict | None) -> dict[str, float]:
    """``batch``'s flip bound at the tolerance's hidden rel_norm (``engines.flips.flip_bound``)."""
    from spec_serve.engines import packing
    from spec_serve.engines.flips import flip_bound

    rel_norm = packing.TOLERANCE[engine.model.dtype].hidden_rel_norm
    return flip_bound(engine, tuple(t.to(engine.device) for t in batch), rel_norm, reference=reference)


def verified(passed: int, total: int) -> dict[str, Any]:
    """A figure's verification fields: ``verified`` "N/M", and ``status: INVALID`` unless all M passed."""
    return {"verified": f"{passed}/{total}", **({} if passed == total and total else {"status": "INVALID"})}


@contextlib.contextmanager
def worker_threads(device: torch.device):
    """On CPU, run with the math threads one worker gets (``launch`` starts each with OMP_NUM_THREADS,
    1 unless set): more threads than that, on cores the workers share, measure oversubscription (on
    the loaded 2-core box a 2-thread forward ran 25x slower than a 1-thread one) instead of the forward."""
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------- colocated


def run_colocated(ctx: Context, compact: bool, packed: bool = False, dspark: bool = False,
                  compiled: bool = False) -> dict[str, Any]:
    with worker_threads(ctx.device):
        return _run_colocated(ctx, compact, packed, dspark, compiled)


def _run_colocated(ctx: Context, compact: bool, packed: bool = False, dspark: bool = False,
                   compiled: bool = False) -> dict[str, Any]:
    """The target's own forward, batch after batch: padded (what a trainer runs), compact, DSpark, or packed
    (``HFTarget.generate_packed`` on the host batch, as a packing worker gets it); ``compiled``: on the
    compiled engine. Packed and compiled answers are verified after the clock."""
    from spec_serve.supervision.eagle3 import expand_compact, lm_head_slice

    engine = ctx.compiled_engine() if compiled else ctx.engine()
    device, warmup = ctx.device, ctx.cfg.warmup
    weight = lm_head_slice(engine.get_output_embeddings().weight, ctx.mapping[0]) if compact else None
    mask = ctx.mapping[1].to(device)
    batches = ctx.batches if packed else [tuple(t.to(device) for t in b) for b in ctx.batches]
    outputs: list[dict[str, torch.Tensor]] = []
    nbytes, start = 0, 0.0
    for i, b in enumerate(batches):
        if i == warmup:
            _sync(device)
            start, nbytes, outputs = time.perf_counter(), 0, []
        if compact:
            out = expand_compact(engine.generate_batch(*b, kind="eagle3_compact"), cast(torch.Tensor, weight), mask)
        elif packed:
            out = engine.generate_packed([b], kind="eagle3")[0]
        elif dspark:
            out = engine.generate_batch(*b, kind="dspark")
        else:
            out = engine.generate_batch(*b, kind="eagle3")
        if packed or compiled:
            outputs.append(out)
        else:  # consumed as a remote scenario consumes its batches, and the reference remote ones are checked against
            ctx.keep_reference(i, out, kind="dspark" if dspark else "eagle3", compact=compact)
        nbytes += _nbytes(out)
    _sync(device)
    seconds = time.perf_counter() - start
    tokens, padded = _tokens(ctx.batches[warmup:])
    name = "colocated_compact" if compact else "colocated_packed" if packed else "colocated_dspark" if dspark \
        else "colocated"
    if compiled:
        name += "_compiled"
        return _figure(name, tokens, nbytes, seconds, padded, **ctx.verify_compiled(ctx.batches[warmup:], outputs))
    checked = verify_packed(engine, ctx.batches[warmup:], outputs, flip_bounds=ctx.flip_bounds) if packed else {}
    return _figure(name, tokens, nbytes, seconds, padded, **checked)


# ---------------------------------------------------------------------- remote


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


# ------------------------------------------------------------------- transport


def _null_worker(args: list[str]) -> None:
    from spec_serve.tools.null_engine import run_worker

    run_worker(args[0], args[1])


def _direct_server(args: list[str]) -> None:
    """A ROUTER that answers each [reqid, ...] with data-message frames of the null tensors."""
    import zmq

    from spec_serve.protocol import wire
    from spec_serve.protocol.commands import Status, data_message
    from spec_serve.tools.null_engine import null_tensors
    from spec_serve.transport.sockets import make_socket

    endpoint_file, batch, seq = args[0], int(args[1]), int(args[2])
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*")
    Path(endpoint_file).write_text(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    tensors = null_tensors(batch, seq)
    while True:
        frames = sock.recv_multipart(copy=False)
        if len(frames) == 2 and frames[1].bytes == b"stop":
            return
        # Encoded per reply, as the worker does (zero-copy views, a small header).
        sock.send_multipart([frames[0], *data_message(Status.OK, frames[1].bytes, {}, wire.encode(tensors))],
                            copy=False)


def _push_sender(args: list[str]) -> None:
    """PUSH ``count`` messages of the null tensors' bytes: raw 16 MiB frames, or wire.encode frames."""
    import zmq

    from spec_serve.protocol import wire
    from spec_serve.tools.null_engine import null_tensors
    from spec_serve.transport.sockets import make_socket

    endpoint, mode, count, batch, seq = args[0], args[1], *map(int, args[2:5])
    tensors = null_tensors(batch, seq)
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.PUSH, connect=endpoint, hwm=4)
    if mode == "raw":
        blob = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors.values()])
        view = blob.numpy().data
        raw = [view[i : i + wire.MAX_FRAME_BYTES] for i in range(0, len(view), wire.MAX_FRAME_BYTES)]
    for _ in range(count):
        frames = raw if mode == "raw" else wire.encode(tensors)
        sock.send_multipart(frames, copy=False)
    sock.send(b"")  # end marker
    time.sleep(0.5)
    sock.close(linger=2000)


def _spawn_helper(kind: str, *args: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "spec_serve.tools.bench", kind, *map(str, args)],
                            env=os.environ.copy(), start_new_session=True)


def run_push(ctx: Context, mode: str, transport: str = "tcp") -> dict[str, Any]:
    import zmq

    from spec_serve.paths.frames.hostpool import RecyclingAllocator
    from spec_serve.protocol import wire
    from spec_serve.transport.sockets import make_socket

    cfg = ctx.cfg
    alloc = RecyclingAllocator()  # as the client's I/O thread decodes
    zctx: zmq.SyncContext = zmq.Context.instance()
    bind = "tcp://127.0.0.1:*" if transport == "tcp" else f"ipc://{ctx.tmp}/push.sock"
    pull = make_socket(zctx, zmq.PULL, bind=bind, hwm=4)
    endpoint = pull.getsockopt_string(zmq.LAST_ENDPOINT)
    count = cfg.transport_messages + 1
    proc = _spawn_helper("_push_sender", endpoint, mode, count, 1, cfg.transport_seq)
    try:
        nbytes = 0
        pull.recv_multipart(copy=False)  # the first message pays connection set-up
        start = time.perf_counter()
        while True:
            frames = pull.recv_multipart(copy=False)
            if len(frames) == 1 and len(frames[0]) == 0:
                break
            if mode == "raw":
                nbytes += sum(len(f) for f in frames)
            else:
                nbytes += _nbytes(wire.decode(frames, alloc=alloc if ctx.recycle else None))
        seconds = time.perf_counter() - start
    finally:
        proc.wait(30)
        pull.close(0)
    name = ("zmq_raw" if mode == "raw" else "frames") + ("" if transport == "tcp" else f"_{transport}")
    return _figure(name, 0, nbytes, seconds, messages=cfg.transport_messages)


def run_direct(ctx: Context) -> dict[str, Any]:
    import zmq

    from spec_serve.protocol import wire
    from spec_serve.protocol.commands import new_request_id, parse_data
    from spec_serve.transport.sockets import make_socket

    cfg = ctx.cfg
    endpoint_file = Path(ctx.tmp) / "direct.endpoint"
    proc = _spawn_helper("_direct_server", endpoint_file, 1, cfg.transport_seq)
    deadline = time.monotonic() + 120
    while not endpoint_file.exists() or not endpoint_file.read_text():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("direct server did not start")
        time.sleep(0.05)
    dealer = make_socket(zmq.Context.instance(), zmq.DEALER, connect=endpoint_file.read_text())
    request = wire.encode(dict(zip(("input_ids", "attention_mask", "loss_mask"),
                                   make_batch(1, cfg.transport_seq, 2, 0))))
    try:
        def one_round(n: int) -> int:
            got, received, inflight, sent = 0, 0, 0, 0
            while received < n:
                while inflight < cfg.prefetch and sent < n:
                    dealer.send_multipart([new_request_id(), *request], copy=False)
                    inflight, sent = inflight + 1, sent + 1
                _, _, _, payload = parse_data(dealer.recv_multipart(copy=False))
                got += _nbytes(wire.decode(payload))
                received, inflight = received + 1, inflight - 1
            return got

        one_round(cfg.warmup or 1)
        start = time.perf_counter()
        nbytes = one_round(cfg.transport_messages)
        seconds = time.perf_counter() - start
        dealer.send(b"stop")
    finally:
        dealer.close(0)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    tokens = cfg.transport_messages * cfg.transport_seq
    return _figure("direct_null", tokens, nbytes, seconds)


def transport_run(frontend: str, kind: str, messages: int, seq: int, prefetch: int, warmup: int,
                  plane: bool = False, service: str = "null") -> dict[str, Any]:
    """Transport only: ``messages`` requests of 1 x ``seq`` tokens to the null worker (8B-shaped replies of
    ``kind``: "eagle3" full, or "eagle3_compact", what compact="auto" sends across hosts, landed and not
    expanded), ``prefetch`` in flight; as frames, or (``plane``) lent through the same-host plane. Every
    reply is checked against what the null engine answers once the clock stopped."""
    from spec_serve.client.api import RemoteTargetModel
    from spec_serve.tools.null_engine import VOCAB, null_mapping, null_tensors
    from spec_serve.tools.verify import mismatch

    with RemoteTargetModel(frontend, service=service, prefetch_depth=prefetch, timeout=600, compact=False,
                           same_host_plane=plane, wire_dtype="auto") as client:
        client.set_vocab_mapping(*null_mapping())
        batch = make_batch(1, seq, VOCAB, 0)
        for _ in range(warmup or 1):
            client.generate_batch(*batch, kind=kind)
        start = time.perf_counter()
        futures = [client.generate_batch_async(*batch, kind=kind) for _ in range(messages)]
        nbytes = sum(_nbytes(f.result()) for f in futures)
        seconds = time.perf_counter() - start
        stats = client.stats
    want = null_tensors(1, seq, kind)
    return {"tokens": messages * seq, "bytes": nbytes, "seconds": seconds, "plane_replies": stats.plane_replies,
            **verified(sum(mismatch(f.result(), want) is None for f in futures), len(futures))}


def run_broker_null(ctx: Context, plane: bool = False, compact: bool = False) -> dict[str, Any]:
    """Transport only through the broker (``transport_run``): full EAGLE-3 replies, or compact ones."""
    cfg = ctx.cfg
    got = transport_run(ctx.frontend, "eagle3_compact" if compact else "eagle3", cfg.transport_messages,
                        cfg.transport_seq, cfg.prefetch, cfg.warmup, plane)
    name = ("samehost_null" if plane else "broker_null") + ("_compact" if compact else "")
    tokens, nbytes, seconds = got.pop("tokens"), got.pop("bytes"), got.pop("seconds")
    return _figure(name, tokens, nbytes, seconds, **got)


def run_worker_pool(ctx: Context) -> dict[str, Any]:
    """The worker's hot path in-process: forward, host copy (pinned pool on a GPU), encode; release as sent."""
    with worker_threads(ctx.device):  # as a worker process runs it
        return _run_worker_pool(ctx)


def _run_worker_pool(ctx: Context) -> dict[str, Any]:
    from spec_serve.protocol import wire
    from spec_serve.worker.server import Job, Worker

    engine = ctx.engine()
    worker = Worker(engine, "tcp://127.0.0.1:1", capacity=2)
    worker.vocab.put("bench", ctx.mapping)
    batch = dict(zip(("input_ids", "attention_mask", "loss_mask"), ctx.batches[0]))
    header = {"op": "generate", "kind": "eagle3", "vocab": "bench", "reply_to": "tcp://127.0.0.1:1"}
    n = max(ctx.cfg.steps, 4)
    start = time.perf_counter()
    for _ in range(n):
        result = worker.serve(Job(bytes(16), header, wire.encode(batch), time.monotonic()))
        if result.ready is not None:
            result.ready.synchronize()  # the I/O thread sends only once the device->host copy is done
        if result.loan is not None:
            result.loan.left()  # what the I/O thread does once ZeroMQ has sent the frames
    seconds = time.perf_counter() - start
    pool = worker.host_pool  # None for a CPU engine (no --host-pool): replies borrow its outputs
    return _figure("worker_pool", n * int(batch["attention_mask"].sum()), 0, seconds, messages=n,
                   pool_allocations=pool.stats()["allocations"] if pool else 0, pooled=pool is not None)


def _fresh(ctx: Context) -> dict[str, Any]:
    ctx.recycle = False
    try:
        return run_push(ctx, "wire")
    finally:
        ctx.recycle = True


def _row_noise(engine, batch) -> dict[str, float]:
    from spec_serve.engines import packing

    ids, attn, loss = (t.to(engine.device) for t in batch)
    inside = engine.generate_batch(ids, attn, loss, kind="eagle3")
    worst: dict[str, float] = {}
    for row, n in enumerate(attn.sum(1).tolist()):
        alone = engine.generate_batch(ids[row:row + 1, :n], attn[row:row + 1, :n], loss[row:row + 1, :n],
                                      kind="eagle3")
        same_rows = {name: t[row:row + 1, :n] for name, t in inside.items()}
        for name, measures in packing.compare(alone, same_rows, attn[row:row + 1, :n]).items():
            for measure, value in measures.items():
                if measure != "mismatch":  # input_ids, loss_mask: exact by construction
                    worst[f"{name}.{measure}"] = max(worst.get(f"{name}.{measure}", 0.0), value)
    return worst


# ---------------------------------------------------------------- compile time


def run_compile_time(ctx: Context) -> dict[str, Any]:
    """compile_cold, compile_warm, compile_warm_packing, compile_warm_unsaved and compile_artifacts, each a fresh
    process (``_compile_probe``) on the target, in that order; the figures go into the report at once
    (``Context.extra_figures``). compile_warm is the load of a worker without --packing (no packed class), the
    others a packing worker's (every class; the cold one so fills the cache for both)."""
    cold_dir, fresh_dir = Path(ctx.tmp) / "inductor-cold", Path(ctx.tmp) / "inductor-artifacts"
    artifacts = Path(ctx.tmp) / "compile-artifacts.bin"
    for d in (cold_dir, fresh_dir):
        shutil.rmtree(d, ignore_errors=True)
    artifacts.unlink(missing_ok=True)
    runs = {"compile_cold": (cold_dir, "save", True), "compile_warm": (cold_dir, "", False),
            "compile_warm_packing": (cold_dir, "", True), "compile_warm_unsaved": (cold_dir, "forget", True),
            "compile_artifacts": (fresh_dir, "load", True)}
    figures = {name: _compile_probe(ctx, name, cache, mode, artifacts, packed)
               for name, (cache, mode, packed) in runs.items()}
    ctx.extra_figures.update({k: v for k, v in figures.items() if k != "compile_cold"})
    return figures["compile_cold"]


# The compile-time targets at the Llama-3.1-8B shape on one H200 (issue 26).
COMPILE_TARGET_S = {"compile_cold": 30.0, "compile_warm": 5.0, "compile_warm_packing": 5.0}


def _compile_probe(ctx: Context, name: str, cache: Path, mode: str, artifacts: Path, packed: bool) -> dict[str, Any]:
    aux = LLAMA_8B_AUX_LAYERS if ctx.cfg.gpu_8b else ""
    args = [ctx.target, str(ctx.device), ctx.cfg.dtype or "", aux, str(cache), mode, str(artifacts),
            "packed" if packed else ""]
    proc = subprocess.run([sys.executable, "-m", "spec_serve.tools.bench", "_compile_probe", *args],
                          capture_output=True, text=True, env=os.environ.copy(), timeout=1800)
    if proc.returncode != 0:
        tail = " ".join(proc.stderr.strip().splitlines()[-3:])
        return _figure(name, 0, 0, 0.0, status="INVALID", error=tail[-500:])
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    seconds = round(report["seconds"] + report["artifacts_seconds"], 2)
    return _figure(name, 0, 0, seconds, load_seconds=report["load_seconds"], graphs=report["graphs"],
                   cache_hits=report["cache_hits"], cache_misses=report["cache_misses"],
                   compiled=report["active"], h200_target_s=COMPILE_TARGET_S.get(name),
                   artifacts_seconds=report["artifacts_seconds"], device_seconds=report["device_seconds"],
                   phases=report["phases"], classes=report["classes"], manifest=report["manifest"],
                   loaded=report["loaded"], saved_classes_off=report["saved_classes_off"],
                   saved_classes_issue=report["saved_classes_issue"],
                   **({} if report["active"] else {"status": "INVALID", "error": report["reason"]}))


def _compile_probe_main(args: list[str]) -> None:
    """A fresh process: build ``HFTarget(compile=True)`` on an Inductor cache dir and print its compile report as
    JSON. ``save``: then write the cache artifacts; ``load``: first load them (timed: ``artifacts_seconds``);
    ``forget``: first delete the manifests and saved classes loads left in the cache (Inductor's kernels stay).
    ``packed`` empty: the engine of a worker without --packing (``compile_packed=False``)."""
    from spec_serve.engines import compiled
    from spec_serve.engines.hf import HFTarget

    target, device, dtype, aux, cache, mode, artifacts, packed = args
    started = time.perf_counter()
    if mode == "load":
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        torch.compiler.load_cache_artifacts(Path(artifacts).read_bytes())
    artifacts_seconds = time.perf_counter() - started
    if mode == "forget":
        shutil.rmtree(Path(cache) / compiled.MANIFEST_DIR, ignore_errors=True)
    started = time.perf_counter()
    engine = HFTarget(target, device=device, dtype=dtype or None, compile=True, compile_cache=cache,
                      compile_packed=bool(packed), aux_layer_ids=[int(i) for i in aux.split(",")] if aux else None)
    load_seconds = time.perf_counter() - started
    if mode == "save":
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            Path(artifacts).write_bytes(saved[0])
    report = dataclasses.asdict(cast("CompileReport", engine.compile_report))
    print(json.dumps({**report, "load_seconds": round(load_seconds, 2),
                      "artifacts_seconds": round(artifacts_seconds, 2)}), flush=True)


# --------------------------------------------------------------------- context


# Services of one worker on the first device, and the flags that worker takes besides the common ones.
ONE_WORKER_SERVICES = {"w1": (), "nccl": (), "packed": ("--packing",), "compiled": ("--compile",),
                       "compiled_packed": ("--packing", "--compile")}


class Context:
    """What scenarios share: config, target, batches, mapping, the cluster (started lazily)."""

    def __init__(self, cfg: BenchConfig, tmp: str):
        from spec_serve.supervision.vocab import build_vocab_mapping
        from spec_serve.tools.random_target import write_random_init_target
        from spec_serve.tools.tiny import make_tiny_target

        self.cfg, self.tmp = cfg, tmp
        self.device = torch.device(cfg.devices[0])
        if cfg.target:
            self.target = cfg.target
        elif cfg.gpu_8b:
            self.target = str(write_random_init_target(Path(tmp) / "llama-8b-shape", LLAMA_8B_CONFIG))
        else:
            self.target = str(make_tiny_target(Path(tmp) / "tiny"))
        self.config = json.loads((Path(self.target) / "config.json").read_text())
        vocab = int(self.config["vocab_size"])
        self.info = {"vocab_size": vocab, "hidden_size": int(self.config["hidden_size"])}
        lengths = row_lengths(cfg.lengths, max(cfg.warmup, 1) + cfg.steps, cfg.batch, cfg.seq)
        self.batches = [padded_batch(rows, vocab, seed=s) for s, rows in enumerate(lengths)]
        ids = torch.cat([b[0].reshape(-1) for b in self.batches[:4]])
        loss = torch.cat([b[2].reshape(-1) for b in self.batches[:4]])
        self.mapping = build_vocab_mapping(ids, loss, vocab, min(cfg.draft_vocab, vocab))
        dtype_bytes = 2 if (cfg.dtype or self.config.get("torch_dtype", "float32")) in ("bfloat16", "float16") else 4
        self.dtype_bytes = dtype_bytes
        self.reply_bytes_per_token = bytes_per_token(self.info["hidden_size"], min(cfg.draft_vocab, vocab),
                                                     dtype_bytes)
        self._engine = None
        self._compiled = None
        self._noise: dict[int, dict[str, float]] = {}  # batch -> the eager forward's batch-composition noise
        self._flip_bounds: dict[int, dict[str, float]] = {}  # batch -> its derived flip bound
        self._references: dict[tuple, dict] = {}  # (batch, how it was received) -> its colocated fingerprint
        self.recycle = True
        self.cluster: Cluster | None = None  # started by start_cluster
        self.extra_figures: dict[str, dict] = {}  # figures a scenario measured besides its own (compile_*)
        self._stack = contextlib.ExitStack()

    def engine(self):
        if self._engine is None:
            from spec_serve.engines.hf import HFTarget

            self._engine = HFTarget(self.target, device=self.device, dtype=self.cfg.dtype,
                                    aux_layer_ids=self._aux_ids())
            self._engine.set_vocab_mapping(*self.mapping)
        return self._engine

    def compiled_engine(self):
        """A second colocated engine, ``HFTarget(compile=True)`` (started after the workers: it loads the
        kernels a compiling worker already put in the Inductor cache)."""
        if self._compiled is None:
            from spec_serve.engines.hf import HFTarget

            with worker_threads(self.device):
                self._compiled = HFTarget(self.target, device=self.device, dtype=self.cfg.dtype,
                                          aux_layer_ids=self._aux_ids(), compile=True)
            self._compiled.set_vocab_mapping(*self.mapping)
        return self._compiled

    def verify_compiled(self, batches, outputs, remote: bool = False) -> dict[str, Any]:
        """Compiled answers: within ``compiled.TOLERANCE`` of the colocated eager forward (``verify_packed``),
        next to the eager forward's own batch-composition noise on the same rows (``noise``); a ``remote``
        worker's padded answers also counted bit-equal to the colocated compiled forward
        (``bit_equal_compiled``; a packing worker's are not, as queued requests may share a forward)."""
        from spec_serve.tools.verify import mismatch

        with worker_threads(self.device):
            checked = verify_packed(self.engine(), batches, outputs, flip_bounds=self.flip_bounds)
            checked["noise"] = self.batch_noise(batches)
            if remote:
                engine = self.compiled_engine()
                equal = sum(mismatch(out, engine.generate_batch(*b, kind="eagle3")) is None
                            for b, out in zip(batches, outputs))
                checked["bit_equal_compiled"] = f"{equal}/{len(outputs)}"
        return checked

    def flip_bounds(self, batch, reference: dict | None = None) -> dict[str, float]:
        """``batch``'s flip bound (``verify_packed``), derived once per batch and kept over rounds."""
        if id(batch[0]) not in self._flip_bounds:
            with worker_threads(self.device):
                self._flip_bounds[id(batch[0])] = _flip_bounds(self.engine(), batch, reference)
        return self._flip_bounds[id(batch[0])]

    def batch_noise(self, batches) -> dict[str, float]:
        """The eager forward's batch-composition noise on these rows (the yardstick compiled and packed
        answers are held against, docs/compile.md): each row alone, as a batch of one of its real tokens,
        against the same row inside its batch (``packing.compare``), worst per measure over all rows."""
        worst: dict[str, float] = {}
        for b in batches:
            if id(b[0]) not in self._noise:
                self._noise[id(b[0])] = _row_noise(self.engine(), b)
            for key, value in self._noise[id(b[0])].items():
                worst[key] = max(worst.get(key, 0.0), value)
        return {k: float(f"{v:.3g}") for k, v in sorted(worst.items())}

    def verify(self, batch: tuple, got: dict, *, shards: int = 1, compact: bool = False,
               device: torch.device | None = None, kind: str = "eagle3", quiet: bool = False) -> bool:
        """Whether ``got`` equals, bit for bit, the colocated forward of ``batch`` as a client with
        ``shards`` shards (and ``compact``, expanded on ``device``) receives it; a mismatch is printed."""
        from spec_serve.tools.verify import colocated_reference, mismatch

        with worker_threads(self.device):
            want = colocated_reference(self.engine(), batch, kind, shards=shards, compact=compact,
                                       device=device, selected=self.mapping)
        wrong = mismatch(got, want)
        if wrong is not None and not quiet:
            print(f"[bench] a batch differs from the colocated forward: {wrong}", file=sys.stderr, flush=True)
        return wrong is None

    def keep_reference(self, i: int, out: dict[str, torch.Tensor], *, kind: str, compact: bool) -> None:
        """The colocated forward's answer to batch ``i`` (unsharded, compact ones expanded on this device),
        fingerprinted (``verify.fingerprint``) as the reference remote answers to it are checked against."""
        from spec_serve.tools.verify import fingerprint

        self._references.setdefault(self._reference_key(i, kind, 1, compact, self.device), fingerprint(out))

    def check(self, i: int, got, *, shards: int = 1, compact: bool = False, device: torch.device | None = None,
              kind: str = "eagle3", quiet: bool = False) -> bool:
        """Whether the fingerprint ``got`` of a remote answer to batch ``i`` equals that of the colocated
        forward as a client with ``shards`` shards (and ``compact``, expanded on ``device``) receives it: the
        colocated scenario's own answer where it ran, else computed once and kept for every round."""
        from spec_serve.tools.verify import colocated_reference, fingerprint, fingerprint_mismatch

        key = self._reference_key(i, kind, shards, compact, device or self.device)
        if key not in self._references:
            with worker_threads(self.device):
                want = colocated_reference(self.engine(), self.batches[i], kind, shards=shards, compact=compact,
                                           device=device, selected=self.mapping)
            self._references[key] = fingerprint(want)
        wrong = fingerprint_mismatch(got, self._references[key])
        if wrong is not None and not quiet:
            print(f"[bench] batch {i} differs from the colocated forward: {wrong}", file=sys.stderr, flush=True)
        return wrong is None

    @staticmethod
    def _reference_key(i: int, kind: str, shards: int, compact: bool, device: torch.device) -> tuple:
        return i, kind, shards, compact, str(device) if compact else None  # only an expansion depends on the device

    def _aux_ids(self):
        return [int(i) for i in LLAMA_8B_AUX_LAYERS.split(",")] if self.cfg.gpu_8b else None

    @property
    def frontend(self) -> str:
        """The cluster's client endpoint; scenarios that use it run after ``start_cluster``."""
        assert self.cluster is not None, "start_cluster first"
        return self.cluster.frontend

    def start_cluster(self, services: set[str]) -> None:
        """One broker; each service its own workers (all start in parallel, then we wait)."""
        from spec_serve.tools.launch import Cluster

        cfg = self.cfg
        log_dir = Path(cfg.log_dir) if cfg.log_dir else None
        cluster = Cluster.on_free_ports(env={"SPEC_SERVE_UNKNOWN_SERVICE_GRACE": "600"}, log_dir=log_dir)
        self._stack.callback(cluster.stop)
        cluster.start_broker()
        common = ["--capacity", "2"]
        if cfg.dtype:
            common += ["--dtype", cfg.dtype]
        if cfg.gpu_8b:
            common += ["--aux-layer-ids", LLAMA_8B_AUX_LAYERS]
        second = cfg.devices[1] if len(cfg.devices) > 1 else cfg.devices[0]
        expected = 0
        for service in sorted(services & ONE_WORKER_SERVICES.keys()):
            cluster.start_worker(self.target, "--device", cfg.devices[0], *ONE_WORKER_SERVICES[service], *common,
                                 service=service)
            expected += 1
        if "w2" in services:
            for device in (cfg.devices[0], second):
                cluster.start_worker(self.target, "--device", device, *common, service="w2")
            expected += 2
        if "batch" in services:
            cluster.start_worker(self.target, "--device", cfg.devices[0], "--packing", "--max-batch-tokens",
                                 str(cfg.max_batch_tokens),
                                 *[a for a in common if a not in ("--capacity", "2")], "--capacity", "8",
                                 service="batch")
            expected += 1
        if "null" in services:  # tools/null_engine.py: the 8B reply shape, whatever the target
            proc = _spawn_helper("_null_worker", cluster.backend, "null")
            cluster.workers.append(proc)
            expected += 1
        cluster.wait_workers(expected, timeout=900)
        self.cluster = cluster

    def close(self) -> None:
        self._stack.close()


# ------------------------------------------------------------------ scenarios

# name -> (services it needs, function).
SCENARIOS: dict[str, tuple[set, Callable[[Context], dict]]] = {
    "colocated": (set(), lambda c: run_colocated(c, compact=False)),
    "colocated_compact": (set(), lambda c: run_colocated(c, compact=True)),
    "colocated_packed": (set(), lambda c: run_colocated(c, compact=False, packed=True)),
    "remote_1w_packed": ({"packed"}, lambda c: run_remote(c, "packed", False, 1, "remote_1w_packed", packed=True)),
    "remote_1w_compact_packed": ({"packed"}, lambda c: run_remote(c, "packed", True, 1, "remote_1w_compact_packed",
                                                                  packed=True)),
    # The packing worker through the same-host plane, the client on the worker's GPU or its own.
    "samehost_1w_packed": ({"packed"}, lambda c: run_remote(c, "packed", False, 1, "samehost_1w_packed",
                                                            packed=True, plane=True)),
    "samehost_1w_compact_packed": ({"packed"}, lambda c: run_remote(c, "packed", True, 1,
                                                                    "samehost_1w_compact_packed", packed=True,
                                                                    plane=True)),
    "samehost_1w_packed_own_gpu": ({"packed"}, lambda c: run_remote(c, "packed", False, 1,
                                                                    "samehost_1w_packed_own_gpu", packed=True,
                                                                    plane=True, own_device=True)),
    "remote_1w_compact_packed_own_gpu": ({"packed"}, lambda c: run_remote(c, "packed", True, 1,
                                                                          "remote_1w_compact_packed_own_gpu",
                                                                          packed=True, own_device=True)),
    "colocated_dspark": (set(), lambda c: run_colocated(c, compact=False, dspark=True)),
    # Compiled decoder layers (docs/compile.md): colocated, and workers started with --compile.
    "colocated_compiled": (set(), lambda c: run_colocated(c, compact=False, compiled=True)),
    "colocated_packed_compiled": (set(), lambda c: run_colocated(c, compact=False, packed=True, compiled=True)),
    "samehost_1w_compiled": ({"compiled"}, lambda c: run_remote(c, "compiled", False, 1, "samehost_1w_compiled",
                                                                plane=True, compiled=True)),
    "samehost_1w_packed_compiled": ({"compiled_packed"},
                                    lambda c: run_remote(c, "compiled_packed", False, 1, "samehost_1w_packed_compiled",
                                                         packed=True, plane=True, compiled=True)),
    "compile_cold": (set(), run_compile_time),
    # Replies as frames (the same-host plane off), as a client on another host gets them.
    "remote_1w": ({"w1"}, lambda c: run_remote(c, "w1", False, 1, "remote_1w")),
    "remote_1w_compact": ({"w1"}, lambda c: run_remote(c, "w1", True, 1, "remote_1w_compact")),
    # The client's defaults (compact="auto") with the plane off, as a client on another host has them: the
    # worker answers compact, the client expands on its device.
    "remote_1w_auto": ({"w1"}, lambda c: run_remote(c, "w1", "auto", 1, "remote_1w_auto")),
    "remote_1w_dspark": ({"w1"}, lambda c: run_remote(c, "w1", False, 1, "remote_1w_dspark", dspark=True)),
    # The same worker, the client (and its H2D copies, compact expansion) on the last device, as a
    # trainer on a GPU of its own would be; on one device identical to the above.
    "remote_1w_own_gpu": ({"w1"}, lambda c: run_remote(c, "w1", False, 1, "remote_1w_own_gpu", own_device=True)),
    "remote_1w_compact_own_gpu": ({"w1"}, lambda c: run_remote(c, "w1", True, 1, "remote_1w_compact_own_gpu",
                                                               own_device=True)),
    "remote_2w": ({"w2"}, lambda c: run_remote(c, "w2", False, 2, "remote_2w")),
    "remote_2w_compact": ({"w2"}, lambda c: run_remote(c, "w2", True, 2, "remote_2w_compact")),
    # The same-host plane (CUDA IPC between GPUs, shared memory otherwise).
    "samehost_1w": ({"w1"}, lambda c: run_remote(c, "w1", False, 1, "samehost_1w", plane=True)),
    "samehost_1w_compact": ({"w1"}, lambda c: run_remote(c, "w1", True, 1, "samehost_1w_compact", plane=True)),
    "samehost_1w_dspark": ({"w1"}, lambda c: run_remote(c, "w1", False, 1, "samehost_1w_dspark", plane=True,
                                                        dspark=True)),
    "samehost_1w_own_gpu": ({"w1"}, lambda c: run_remote(c, "w1", False, 1, "samehost_1w_own_gpu", own_device=True,
                                                         plane=True)),
    "samehost_2w": ({"w2"}, lambda c: run_remote(c, "w2", False, 2, "samehost_2w", plane=True)),
    "samehost_2w_compact": ({"w2"}, lambda c: run_remote(c, "w2", True, 2, "samehost_2w_compact", plane=True)),
    # Bound worker on the first device, client on the last, tensors over a private NCCL pair group
    # (gloo on CPU). Needs two devices on a GPU host.
    "remote_nccl": ({"nccl"}, lambda c: run_remote(c, "nccl", False, 1, "remote_nccl", nccl=True)),
    "remote_nccl_compact": ({"nccl"}, lambda c: run_remote(c, "nccl", True, 1, "remote_nccl_compact", nccl=True)),
    "small_unbatched": ({"w1"}, lambda c: run_small(c, "w1", "small_unbatched")),
    "small_batched": ({"batch"}, lambda c: run_small(c, "batch", "small_batched")),
    "broker_null": ({"null"}, run_broker_null),
    "broker_null_compact": ({"null"}, lambda c: run_broker_null(c, compact=True)),
    "samehost_null": ({"null"}, lambda c: run_broker_null(c, plane=True)),
    "direct_null": (set(), run_direct),
    "zmq_raw": (set(), lambda c: run_push(c, "raw")),
    "frames": (set(), lambda c: run_push(c, "wire")),
    # The same over ipc:// (unix sockets).
    "zmq_raw_ipc": (set(), lambda c: run_push(c, "raw", "ipc")),
    "frames_ipc": (set(), lambda c: run_push(c, "wire", "ipc")),
    # Before/after of the receive-buffer recycling (hostpool.RecyclingAllocator) on the same bytes.
    "frames_fresh": (set(), lambda c: dict(_fresh(c), scenario="frames_fresh")),
    "worker_pool": (set(), run_worker_pool),
}

# (label, numerator, denominator, target on an H200 or None); ratios of tokens/s (or GB/s).
RATIOS = [
    ("packed / padded forward, colocated (useful tokens/s)", "colocated_packed", "colocated", 1.5),
    ("remote packing worker, compact / colocated padded (useful tokens/s)", "remote_1w_compact_packed", "colocated",
     1.5),
    # Full EAGLE-3 replies keep their padded layout (the contract), so over frames they stay bytes-bound.
    ("remote packing worker, full / colocated padded (useful tokens/s)", "remote_1w_packed", "colocated", None),
    ("same-host plane packing worker, full / colocated padded (useful tokens/s)", "samehost_1w_packed", "colocated",
     1.5),
    ("same-host plane packing worker, compact / colocated padded (useful tokens/s)", "samehost_1w_compact_packed",
     "colocated", 1.5),
    ("same-host plane packing worker, client on its own GPU / colocated padded (useful tokens/s)",
     "samehost_1w_packed_own_gpu", "colocated", 1.5),
    ("remote packing worker compact, client on its own GPU / colocated padded (useful tokens/s)",
     "remote_1w_compact_packed_own_gpu", "colocated", 1.5),
    ("compiled / eager forward, colocated", "colocated_compiled", "colocated", None),
    ("same-host plane compiled worker / colocated eager", "samehost_1w_compiled", "colocated", 1.15),
    ("same-host plane compiled worker / colocated compiled", "samehost_1w_compiled", "colocated_compiled", 0.95),
    ("compiled packed / padded eager forward, colocated (useful tokens/s)", "colocated_packed_compiled", "colocated",
     None),
    ("same-host plane compiled packing worker / colocated padded eager (useful tokens/s)",
     "samehost_1w_packed_compiled", "colocated", 2.0),
    ("same-host plane compiled / eager packing worker (useful tokens/s)", "samehost_1w_packed_compiled",
     "samehost_1w_packed", None),
    ("remote 1 worker / colocated", "remote_1w", "colocated", 0.95),
    ("remote 1 worker compact / colocated compact", "remote_1w_compact", "colocated_compact", 0.95),
    # Issue 25: full EAGLE-3 with the defaults, from another host (the plane off), against the colocated forward.
    ("remote 1 worker, defaults (compact=auto) / colocated", "remote_1w_auto", "colocated", 0.95),
    # Issue 40: the same across hosts with compact=True, against the forward a trainer would otherwise run.
    ("remote 1 worker compact / colocated", "remote_1w_compact", "colocated", 0.97),
    ("remote 1 worker, client on its own GPU / colocated", "remote_1w_own_gpu", "colocated", 0.95),
    ("remote 1 worker compact, client on its own GPU / colocated compact", "remote_1w_compact_own_gpu",
     "colocated_compact", 0.95),
    ("compact / full, remote 1 worker", "remote_1w_compact", "remote_1w", None),
    ("remote 1 worker DSpark / colocated DSpark", "remote_1w_dspark", "colocated_dspark", 0.95),
    ("same-host plane 1 worker / colocated", "samehost_1w", "colocated", 0.98),
    ("same-host plane 1 worker compact / colocated compact", "samehost_1w_compact", "colocated_compact", 0.95),
    ("same-host plane 1 worker DSpark / colocated DSpark", "samehost_1w_dspark", "colocated_dspark", 0.95),
    ("same-host plane, client on its own GPU / colocated", "samehost_1w_own_gpu", "colocated", 0.95),
    ("same-host plane / frames, 1 worker", "samehost_1w", "remote_1w", None),
    ("same-host plane 2 workers / 1 worker", "samehost_2w", "samehost_1w", 1.9),
    ("same-host plane 2 workers / 1 worker, compact", "samehost_2w_compact", "samehost_1w_compact", 1.9),
    ("remote NCCL / colocated", "remote_nccl", "colocated", 0.95),
    ("remote NCCL / remote frames, 1 worker", "remote_nccl", "remote_1w", None),
    ("remote NCCL compact / colocated compact", "remote_nccl_compact", "colocated_compact", 0.95),
    ("2 workers / 1 worker", "remote_2w", "remote_1w", 1.9),
    ("2 workers / 1 worker, compact", "remote_2w_compact", "remote_1w_compact", 1.9),
    ("small requests: batched / unbatched", "small_batched", "small_unbatched", None),
    ("broker path / direct socket (same bytes)", "broker_null", "direct_null", None),
    ("same-host plane / frames through the broker, transport only (same bytes)", "samehost_null", "broker_null",
     None),
    ("compact / full replies through the broker, transport only (tokens/s)", "broker_null_compact", "broker_null",
     None),
    ("frames / raw ZeroMQ (same bytes)", "frames", "zmq_raw", 0.9),
    ("frames / raw ZeroMQ, ipc (same bytes)", "frames_ipc", "zmq_raw_ipc", 0.9),
    ("raw ZeroMQ: ipc / tcp loopback", "zmq_raw_ipc", "zmq_raw", None),
    ("frames: recycled / fresh receive buffers", "frames", "frames_fresh", None),
]


def run(cfg: BenchConfig, progress: Callable[[str], None] = lambda name: None) -> dict[str, Any]:
    """Run the chosen scenarios ``cfg.repeat`` times; return the JSON-ready report.

    Rounds alternate the scenario order (forward, backward, ...) so slow drift of a shared machine
    (clocks, other jobs) does not favour the scenarios that run first. Each ratio is computed within
    a round, from figures measured minutes apart at most, and reported as the median over rounds with
    its range; each figure is the round with the median rate.
    """
    names = [n for n in SCENARIOS if not cfg.only or n in cfg.only]
    unknown = set(cfg.only) - set(SCENARIOS)
    if unknown:
        raise ValueError(f"unknown scenarios {sorted(unknown)}; choose from {sorted(SCENARIOS)}")
    if cfg.repeat < 1:
        raise ValueError("repeat must be >= 1")
    with tempfile.TemporaryDirectory(prefix="spec-serve-bench-") as tmp:
        ctx = Context(cfg, tmp)
        try:
            services = set().union(*(SCENARIOS[n][0] for n in names)) if names else set()
            if services:
                progress("start cluster")
                ctx.start_cluster(services)
            rounds: list[dict[str, dict]] = []
            for r in range(cfg.repeat):
                figures = {}
                for name in names if r % 2 == 0 else names[::-1]:
                    progress(name if cfg.repeat == 1 else f"{name} ({r + 1}/{cfg.repeat})")
                    figures[name] = SCENARIOS[name][1](ctx)
                    figures.update(ctx.extra_figures)
                    ctx.extra_figures.clear()
                rounds.append(figures)
        finally:
            ctx.close()
        figures = {name: _median_figure([rd[name] for rd in rounds]) for name in rounds[0]} if rounds else {}
        ratios = [_ratio(label, a, b, goal, figures, rounds) for label, a, b, goal in RATIOS
                  if a in figures and b in figures]
        report = {
            "when": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                        "torch": torch.__version__,
                        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
            "config": dataclasses.asdict(cfg),
            "target": {"path": ctx.target, **ctx.info, "layers": ctx.config["num_hidden_layers"],
                       "dtype_bytes": ctx.dtype_bytes},
            "bytes_per_token": {
                "this_target": ctx.reply_bytes_per_token,
                "llama_8b_shape_vd32000_bf16": bytes_per_token(4096, 32000, 2),
                "measured": {n: round(f["bytes"] / f["tokens"], 1) for n, f in figures.items()
                             if f["tokens"] and n.startswith(("colocated", "remote", "samehost"))},
            },
            "figures": figures,
            "ratios": ratios,
        }
    return report


# A remote scenario runs the very forward the colocated one times, plus transport: faster than that by
# more than noise means the figure measures something else (wrong or missing work, a slowed colocated run).
IMPLAUSIBLE_OVER_COLOCATED = 1.10


def _ratio(label: str, a: str, b: str, goal, figures: dict, rounds: list[dict]) -> dict[str, Any]:
    """One ratio row: the median over rounds; status "invalid" (and no value) if either side had a wrong
    batch in any round, "implausible" for a remote padded scenario over 1.10x its colocated one."""
    key = _rate_key(figures[a], figures[b])
    values = sorted(rd[a][key] / rd[b][key] for rd in rounds if rd[a][key] and rd[b][key])
    ratio = {"ratio": label, "of": key, "value": round(_median(values), 3) if values else None,
             "h200_target": goal, "status": "ok"}
    if len(values) > 1:
        ratio["rounds"] = [round(v, 3) for v in values]
    if any(rd[n].get("status") == "INVALID" for rd in rounds for n in (a, b)):
        ratio.update(status="invalid", value=None)
    elif a.startswith(("remote", "samehost")) and b.startswith("colocated") and _forward(a) == _forward(b) \
            and (ratio["value"] or 0) > IMPLAUSIBLE_OVER_COLOCATED:
        ratio["status"] = "implausible"
    return ratio


def _forward(scenario: str) -> tuple[bool, bool]:
    """Which forward a scenario runs: (packed, compiled). Packing skips padding and compiled layers fuse
    kernels, so either may beat a colocated forward of the other kind; never one of its own kind."""
    return "_packed" in scenario, "_compiled" in scenario


def _rate_key(a: dict[str, Any], b: dict[str, Any]) -> str:
    return "tokens_per_s" if a["tokens"] and b["tokens"] else "gb_per_s"


def _median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _median_figure(figures: list[dict[str, Any]]) -> dict[str, Any]:
    """The figure of the median round (by rate), with every round's rate listed when there are several."""
    if len(figures) == 1:
        return figures[0]
    key = _rate_key(figures[0], figures[0])
    ranked = sorted(figures, key=lambda f: f[key] or 0)
    median = dict(ranked[(len(ranked) - 1) // 2], rounds=[f[key] for f in figures])
    if "verified" in median:  # every round's batches count, not the median round's alone
        passed, total = _count_over_rounds(figures, "verified")
        median["verified"] = f"{passed}/{total}"
        median.pop("status", None)
        if passed != total:
            median["status"] = "INVALID"
    if "bit_equal_compiled" in median:
        median["bit_equal_compiled"] = "{}/{}".format(*_count_over_rounds(figures, "bit_equal_compiled"))
    for key in ("worst", "noise"):  # the worst of every round
        if key in median:
            median[key] = {k: max(f[key].get(k, 0.0) for f in figures) for k in median[key]}
    if "flip_bound" in median:  # the lowest of every round
        median["flip_bound"] = {k: min(f["flip_bound"].get(k, v) for f in figures)
                                for k, v in median["flip_bound"].items()}
    return median


def _count_over_rounds(figures: list[dict[str, Any]], key: str) -> tuple[int, int]:
    """An "N/M" count summed over every round's figure."""
    passed = sum(int(f[key].split("/")[0]) for f in figures)
    return passed, sum(int(f[key].split("/")[1]) for f in figures)


def format_table(report: dict[str, Any]) -> str:
    shown = ("scenario", "tokens", "bytes", "seconds", "tokens_per_s", "gb_per_s", "padded_tokens",
             "padded_tokens_per_s", "tolerance", "worst", "noise", "phases", "classes", "flip_bound")
    lines = [f"{'scenario':<26}{'useful tok/s':>14}{'padded tok/s':>14}{'GB/s':>9}{'seconds':>9}  notes"]
    for name, f in report["figures"].items():
        notes = ", ".join(f"{k}={v}" for k, v in f.items() if k not in shown)
        tps = f"{f['tokens_per_s']:,.0f}" if f["tokens"] and f["tokens_per_s"] else "-"
        padded = f"{f['padded_tokens_per_s']:,.0f}" if f.get("padded_tokens_per_s") else "-"
        lines.append(f"{name:<26}{tps:>14}{padded:>14}{f['gb_per_s'] or 0:>9.3f}{f['seconds']:>9.3f}  {notes}")
    for name, f in report["figures"].items():
        if "worst" in f:
            lines.append(f"  {name} vs colocated padded, worst over batches (bound: {f['tolerance']}; flip bound, "
                         f"lowest over batches: {f.get('flip_bound')}): "
                         + ", ".join(f"{k}={v}" for k, v in f["worst"].items()))
        if "noise" in f:
            lines.append(f"  {name}: the eager forward's own noise on the same rows (alone vs in their batch): "
                         + ", ".join(f"{k}={v}" for k, v in f["noise"].items()))
        if "phases" in f:
            lines.append(f"  {name}: seconds by phase " + ", ".join(f"{k}={v}" for k, v in f["phases"].items())
                         + "; by batch class " + ", ".join(f"{k}={v}" for k, v in f["classes"].items()))
        equal = f.get("bit_equal_compiled", "")
        if equal and equal.split("/")[0] != equal.split("/")[1]:
            lines.append(f"  {name}: NOT bit-equal to the colocated compiled forward ({equal} batches equal)")
    lines.append("")
    lines.append(f"{'ratio':<48}{'value':>8}{'H200 target':>13}  rounds")
    for r in report["ratios"]:
        goal = f">= {r['h200_target']}" if r["h200_target"] else "-"
        spread = " ".join(map(str, r.get("rounds", ())))
        value = "INVALID" if r["status"] == "invalid" else (r["value"] if r["value"] is not None else "-")
        flag = {"invalid": "  (a batch was wrong: see verified= above)",
                "implausible": f"  IMPLAUSIBLE: remote above {IMPLAUSIBLE_OVER_COLOCATED}x its colocated forward"
                }.get(r["status"], "")
        lines.append(f"{r['ratio']:<48}{value:>8}{goal:>13}  {spread}{flag}")
    bpt = report["bytes_per_token"]
    full, comp = bpt["llama_8b_shape_vd32000_bf16"]["eagle3"], bpt["llama_8b_shape_vd32000_bf16"]["eagle3_compact"]
    lines.append("")
    lines.append(f"reply bytes/token at the Llama-3.1-8B shape (Vd=32000, bf16): EAGLE-3 {full / 1024:.1f} KiB, "
                 f"compact {comp / 1024:.1f} KiB ({full / comp:.1f}x fewer)")
    here = bpt["this_target"]
    lines.append(f"reply bytes/token on this target: EAGLE-3 {here['eagle3']} B, compact {here['eagle3_compact']} B; "
                 f"measured (client-side tensors): {bpt['measured']}")
    return "\n".join(lines)


def make_config(target, gpu_8b, devices, dtype, batch, seq, steps, warmup, prefetch, draft_vocab, small_ranks,
                small_requests, small_seq, max_batch_tokens, transport_messages, only, log_dir,
                transport_seq=None, repeat=1, lengths="lognormal") -> BenchConfig:
    """Defaults per mode: the tiny target on CPU, or the 8B shape on the GPUs (4 x 2048, Vd 32000)."""
    if gpu_8b:
        n = torch.cuda.device_count()
        devices = devices or ",".join(f"cuda:{i}" for i in range(min(max(n, 1), 2)))
        dtype = dtype or "bfloat16"
        batch, seq, steps = batch or 4, seq or 2048, steps or 10
        draft_vocab, small_seq = draft_vocab or 32000, small_seq or 512
        max_batch_tokens = max_batch_tokens or 8192
        transport_seq = transport_seq or 1024
    else:
        devices = devices or "cpu"
        batch, seq, steps = batch or 4, seq or 256, steps or 8
        draft_vocab, small_seq = draft_vocab or 256, small_seq or 64
        max_batch_tokens = max_batch_tokens or 4096
        transport_seq = transport_seq or 256
    if lengths not in ("full", "lognormal"):
        _jsonl_lengths(Path(lengths))  # a bad file fails here, before any model is built
    return BenchConfig(target=target, gpu_8b=gpu_8b, devices=tuple(d.strip() for d in devices.split(",") if d.strip()),
                       dtype=dtype, batch=batch, seq=seq, steps=steps, warmup=warmup, prefetch=prefetch,
                       draft_vocab=draft_vocab, small_ranks=small_ranks, small_requests=small_requests,
                       small_seq=small_seq, max_batch_tokens=max_batch_tokens,
                       transport_messages=transport_messages, transport_seq=transport_seq,
                       only=tuple(s.strip() for s in only.split(",") if s.strip()), log_dir=log_dir,
                       repeat=repeat, lengths=lengths)


def main(argv: list[str] | None = None) -> None:
    """``python -m spec_serve.tools.bench``: the ``spec-serve bench`` command (one parser), or a helper process."""
    argv = sys.argv[1:] if argv is None else argv
    helpers = {"_null_worker": _null_worker, "_direct_server": _direct_server, "_push_sender": _push_sender,
               "_compile_probe": _compile_probe_main}
    if argv and argv[0] in helpers:
        helpers[argv[0]](argv[1:])
        return
    from spec_serve.tools.cli import bench

    bench.main(args=argv, prog_name="python -m spec_serve.tools.bench")


if __name__ == "__main__":
    main()
