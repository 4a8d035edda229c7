"""``spec-serve bench``: remote supervision against the target's own forward, measured in one run.

Every figure of a run is measured side by side on the same machine, so the ratios mean something
even on a shared, noisy box (absolute numbers do not travel). Scenarios (``--only`` picks some):

  colocated           HFTarget.generate_batch in this process (forward + supervision on the device)
  colocated_compact   the compact kind + expand_compact on the same device (what the client does)
  colocated_dspark    the DSpark kind
  remote_1w           through the broker, one worker, --prefetch batches in flight, EAGLE-3 full, replies as
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
  zmq_raw             raw ZeroMQ PUSH->PULL over loopback: pre-built 1 MiB frames, same bytes
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

The package: ``config`` (BenchConfig, make_config), ``batches`` (row lengths, padded batches), ``checks``
(figures and their checks), ``context`` (the run's engines, references and cluster), one module per kind of
scenario (``colocated``, ``remote``, ``transport``, ``compile_time``; ``scenarios`` names them all),
``report`` (the run, its ratios, the table), ``helpers`` (helper processes) and ``command`` (the entry point).
"""

from spec_serve.tools.bench.batches import make_batch, padded_batch, row_lengths, worker_threads
from spec_serve.tools.bench.checks import verified, verify_packed
from spec_serve.tools.bench.config import (
    LLAMA_8B_AUX_LAYERS,
    LLAMA_8B_CONFIG,
    BenchConfig,
    bytes_per_token,
    make_config,
)
from spec_serve.tools.bench.context import Context
from spec_serve.tools.bench.report import RATIOS, format_table, run
from spec_serve.tools.bench.scenarios import SCENARIOS
from spec_serve.tools.bench.transport import transport_run

__all__ = ["LLAMA_8B_AUX_LAYERS", "LLAMA_8B_CONFIG", "RATIOS", "SCENARIOS", "BenchConfig", "Context", "bytes_per_token",
           "format_table", "make_batch", "make_config", "padded_batch", "row_lengths", "run", "transport_run",
           "verified", "verify_packed", "worker_threads"]
