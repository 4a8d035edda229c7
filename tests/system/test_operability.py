"""What a user sees off the happy path: fast failures that name the cause, lifecycle log lines,
GPU-user defaults, and operations (health, threads, keys, JSON errors), with real processes.

Issue 15. Every timing bound here is a generous "fails fast instead of hanging" bound.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import fcntl
import http.client
import json
import os
import pty
import select
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import termios
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import zmq
from click.testing import CliRunner

import zygote
from cluster_util import CLIENT_KW, FAST_ENV, Reference, assert_equal_batches, captured_log, kill, wait_until
from spec_serve.client.api import BrokerUnreachable, RemoteTargetModel
from spec_serve.protocol.commands import EXIT_ADDRESS_IN_USE, WORKER_TAG, WorkerCommand, control
from spec_serve.tools.cli import device_and_dtype, join_int_lists, main
from spec_serve.tools.launch import Cluster, free_port, local_cluster
from spec_serve.tools.tiny import sample_batch
from spec_serve.transport.http_shim import HttpShim, json_response
from spec_serve.worker.threads import (
    ThreadShare,
    cgroup_cpus,
    default_threads,
    is_worker_cmdline,
    local_workers,
    parse_cpu_list,
)

GRACE_S = 2  # SPEC_SERVE_UNKNOWN_SERVICE_GRACE of the cluster below
ENV = {**FAST_ENV, "SPEC_SERVE_UNKNOWN_SERVICE_GRACE": str(GRACE_S)}
ENV.pop("SPEC_SERVE_LOG_LEVEL")  # workers log at their default level
# (Clients here heartbeat as often as this broker expects: CLIENT_KW.)


@pytest.fixture(scope="module")
def cluster(tiny_target_dir, tmp_path_factory):
    """A broker and one worker started with NeMo-style space-separated aux layer ids."""
    log_dir = tmp_path_factory.mktemp("operability-logs")
    with local_cluster(tiny_target_dir, workers=1, env=ENV, log_dir=log_dir,
                       worker_args=("--aux-layer-ids", "1", "3", "4")) as c:
        yield c


def spec_serve(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the CLI as a user would, in its own process."""
    return subprocess.run([sys.executable, "-m", "spec_serve.tools.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL, timeout=timeout)


def error_line(proc: subprocess.CompletedProcess) -> str:
    """The CLI failed with one ``Error: ...`` line and no traceback; returns that line."""
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("Error: ")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


# ------------------------------------------------------------------------------------- fail fast


def test_unreachable_broker_fails_within_connect_timeout():
    url = f"tcp://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with captured_log("spec_serve.client") as lines, \
            RemoteTargetModel(url, connect_timeout=1.5, timeout=60, heartbeat_interval=0.1, liveness=3) as target:
        with pytest.raises(BrokerUnreachable) as err:
            target.target_info()
        elapsed = time.monotonic() - started
        with pytest.raises(BrokerUnreachable):  # later calls fail at once too
            target.status()
    message = str(err.value)
    assert elapsed < 15, f"took {elapsed:.1f}s"
    assert url in message and "nothing accepts connections" in message and "--frontend" in message
    assert isinstance(err.value, TimeoutError)  # what callers caught before
    # One line for the failure; no client.broker_lost every liveness window (0.3 s here).
    assert not [line for line in lines if "broker_lost" in line], lines
    assert sum("broker_unreachable" in line for line in lines) == 1, lines


def test_connect_timeout_from_the_environment():
    # Timed inside the process, from the client's creation: interpreter and torch start-up are not the
    # client's doing (they take seconds on a loaded box).
    code = ("import time\nfrom spec_serve.client.api import RemoteTargetModel as R, BrokerUnreachable as B\n"
            f"started = time.monotonic()\nt = R('tcp://127.0.0.1:{free_port()}', timeout=60)\n"
            "try:\n    t.status()\nexcept B as e:\n    print('unreachable:', e)\n"
            "print('seconds:', time.monotonic() - started)\nt.close()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "SPEC_SERVE_CONNECT_TIMEOUT": "1"})
    assert "unreachable:" in out.stdout and "within 1s" in out.stdout, out.stdout + out.stderr
    assert float(out.stdout.rsplit("seconds:", 1)[1]) < 30, out.stdout  # not the request timeout (60 s)


def test_http_port_is_reported_as_another_program(cluster):
    """The broker's HTTP port accepts TCP but speaks no ZeroMQ: the error says so."""
    with RemoteTargetModel(f"tcp://127.0.0.1:{cluster.http_port}", connect_timeout=2, timeout=60) as target:
        with pytest.raises(BrokerUnreachable, match="another program"):
            target.status()


def test_client_on_the_worker_port_is_told_which_port(cluster):
    started = time.monotonic()
    for _ in range(2):  # two misdirected clients: the broker logs one line
        with RemoteTargetModel(cluster.backend, connect_timeout=30, timeout=60) as target:
            with pytest.raises(BrokerUnreachable) as err:
                target.status()
    assert time.monotonic() - started < 20
    frontend_port = cluster.frontend.rpartition(":")[2]
    assert "worker port" in str(err.value) and frontend_port in str(err.value) and "--frontend" in str(err.value)
    log = (cluster.log_dir / "broker.log").read_text()
    assert log.count("broker.wrong_port") == 1, log


def _exited(proc: subprocess.Popen) -> tuple[subprocess.CompletedProcess, float]:
    """What ``proc`` wrote, and when it exited (wall clock, as its log lines are stamped)."""
    out, err = proc.communicate(timeout=180)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), time.time()


def test_worker_checks_its_broker_before_loading_the_model(cluster, tiny_target_dir):
    """Issue 23 item 2: a worker pointed at the broker's client port loaded its whole model before it
    learned so; at an unresolvable name or a closed port it loaded, then waited forever. Now it resolves
    the host and makes a handshake that needs no target first: each fails within seconds with one line
    naming the cause, before the model loads. --wait-for-broker waits, then says how long it waited."""
    closed = f"tcp://127.0.0.1:{free_port()}"
    cases = {
        "client port": ((cluster.frontend,), "client port"),
        "unresolvable": (("tcp://nosuchhost.invalid:5556",), "'nosuchhost.invalid' does not resolve"),
        "refused": ((closed,), "nothing accepts connections"),
        "http port": ((f"tcp://127.0.0.1:{cluster.http_port}",), "another program"),
        "refused, waited": ((closed, "--wait-for-broker", "2"), "(waited 2s)"),
    }
    procs = {name: subprocess.Popen([sys.executable, "-m", "spec_serve.tools.cli", "worker", "--target",
                                     str(tiny_target_dir), "--device", "cpu", "--broker", *args],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                    env={**os.environ, **ENV, "SPEC_SERVE_LOG_LEVEL": "INFO"})
             for name, (args, _) in cases.items()}
    try:
        with concurrent.futures.ThreadPoolExecutor(len(procs)) as pool:  # each exit timed when it happens
            exits = {name: pool.submit(_exited, p) for name, p in procs.items()}
        results = {name: future.result()[0] for name, future in exits.items()}
        ended = {name: future.result()[1] for name, future in exits.items()}
    finally:
        for p in procs.values():
            kill(p)
    for name, (_, expected) in cases.items():
        line = error_line(results[name])
        assert expected in line and "--broker" in line, (name, line)
        assert "worker.loading" not in results[name].stderr, (name, "the model loaded before the check")
        # From its last line before the check (process start-up on a loaded box does not count) to its exit.
        checking = [ln for ln in results[name].stderr.splitlines() if "worker.threads" in ln][0]
        began = datetime.datetime.strptime(checking[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        assert ended[name] - began < 30, (name, f"{ended[name] - began:.0f}s")
    assert "--wait-for-broker" in error_line(results["refused"])
    assert "workers connect to its worker port" in error_line(results["client port"])


def test_worker_on_the_client_port_exits_with_one_line(cluster, tiny_target_dir):
    proc = spec_serve("worker", "--target", str(tiny_target_dir), "--device", "cpu", "--broker", cluster.frontend,
                      env=ENV)
    line = error_line(proc)
    assert "client port" in line and cluster.backend.rpartition(":")[2] in line and "--backend" in line


@pytest.mark.parametrize("url, hint", [
    ("http://broker.example:8080/v1", "tcp://broker.example:5555"),
    ("broker.example:5555", "tcp://broker.example:5555"),
    ("broker.example", "tcp://broker.example:5555"),
    ("tcp://*:5555", "tcp://BROKER:5555"),
])
def test_bad_broker_urls_say_what_to_write(url, hint):
    with pytest.raises(ValueError) as err:
        RemoteTargetModel(url)
    assert hint in str(err.value) and "--frontend" in str(err.value)


def test_unknown_service_fails_after_the_grace_listing_services(cluster):
    started = time.monotonic()
    with RemoteTargetModel(cluster.frontend, service="no-such-target", timeout=60, **CLIENT_KW) as target:
        with pytest.raises(ValueError) as err:
            target.target_info()
    elapsed = time.monotonic() - started
    assert GRACE_S <= elapsed < 30, f"took {elapsed:.1f}s"
    message = str(err.value)
    assert "no-such-target" in message and "'default'" in message and "SPEC_SERVE_UNKNOWN_SERVICE_GRACE" in message


def test_missing_target_directory_fails_at_once(tmp_path):
    """A path that looks local fails at once with its own message and never goes to the hub: a hub
    endpoint given to the worker (HF_ENDPOINT, online) is never connected to."""
    with socket.create_server(("127.0.0.1", 0)) as hub:
        hub_url = f"http://127.0.0.1:{hub.getsockname()[1]}"
        proc = spec_serve("worker", "--target", "./does-not-exist", "--device", "cpu",
                          env={"HF_ENDPOINT": hub_url, "HF_HUB_OFFLINE": "0"})
        assert "target directory ./does-not-exist does not exist" in error_line(proc)
        hub.setblocking(False)
        with pytest.raises(BlockingIOError):  # no connection is waiting: the worker never tried the hub
            hub.accept()
    hub = spec_serve("worker", "--target", "org/not-cached", "--device", "cpu",
                     env={"HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    assert "nor in the Hugging Face cache" in error_line(hub) and "HF_HUB_OFFLINE" in error_line(hub)


def test_cli_errors_are_one_line(cluster, tiny_target_dir, tmp_path):
    """Bad values and load errors: one ``Error:`` line each; a traceback only at --log-level debug."""
    busy = f"tcp://127.0.0.1:{free_port()}"
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(tiny_target_dir / "config.json", broken)
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    worker = ("worker", "--broker", cluster.backend)  # a broker answers: the load is what fails
    cases = {
        "aux": ((*worker, "--target", str(tiny_target_dir), "--aux-layer-ids", "1", "2", "99"),
                "--aux-layer-ids"),
        "load": ((*worker, "--target", str(broken), "--device", "cpu"), f"cannot load {broken}"),
        "load-debug": ((*worker, "--target", str(broken), "--device", "cpu", "--log-level", "DEBUG"), None),
        "port": (("broker", "--frontend", busy, "--backend", f"tcp://127.0.0.1:{free_port()}", "--http-port", "0"),
                 "--frontend"),
        "bind-url": (("broker", "--frontend", "5555"), "tcp://*:5555"),
        "status": (("status", "--broker", f"tcp://127.0.0.1:{free_port()}", "--timeout", "2"),
                   "no spec-serve broker answered"),
    }
    if not torch.cuda.is_available():
        cases["cuda"] = ((*worker, "--target", str(tiny_target_dir), "--device", "cuda:0"), "use --device cpu")
    import zmq

    holder = zmq.Context.instance().socket(zmq.ROUTER)
    holder.bind(busy)  # the port in use
    try:  # all at once, forked from the test zygote: what is checked is each command's output, not its imports
        with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
            futures = {name: pool.submit(zygote.run, ["-m", "spec_serve.tools.cli", *args], dict(os.environ), 120)
                       for name, (args, _) in cases.items()}
        results = {name: future.result() for name, future in futures.items()}
    finally:
        holder.close(0)
    for name, (_, expected) in cases.items():
        if expected is None:
            assert results[name].returncode != 0 and "Traceback" in results[name].stderr, results[name].stderr
        else:
            assert expected in error_line(results[name]), (name, results[name].stderr)
    assert "address already in use" in error_line(results["port"])
    assert results["port"].returncode == EXIT_ADDRESS_IN_USE  # a launcher that picked the port can pick again


# ------------------------------------------------------------------------ say what is happening


def test_worker_logs_its_lifecycle_at_info(tiny_target_dir, tmp_path):
    """Started before its broker (--wait-for-broker): waiting, then, once a broker answers, loading, loaded
    (seconds, memory), ready; broker lost once per outage however long, then regained."""
    c = Cluster.on_free_ports(env=ENV, log_dir=tmp_path)
    try:
        c.start_worker(tiny_target_dir, "--wait-for-broker", "120")
        log = tmp_path / "worker0.log"
        wait_until(lambda: "worker.waiting_for_broker" in log.read_text(), timeout=120, what="waiting")
        # The positive event above comes first: it waits, so nothing has loaded (the order is checked below too).
        assert "worker.loading" not in log.read_text(), "the model loads only once a broker answered"
        c.start_broker()
        wait_until(lambda: "worker.ready" in log.read_text(), timeout=120, what="worker.ready")
        text = log.read_text()
        assert "worker.loading" in text and "device=cpu" in text and "memory=" in text and "seconds=" in text
        assert text.index("worker.broker_checked") < text.index("worker.loading") < text.index("worker.ready")
        assert text.count("worker.waiting_for_broker") == 1, text
        kill(c.broker)
        wait_until(lambda: "worker.broker_lost" in log.read_text(), timeout=60, what="broker lost")
        time.sleep(3)  # 3 s more of silence, 3 more liveness windows: still one broker_lost
        c.start_broker()
        wait_until(lambda: "worker.broker_regained" in log.read_text(), timeout=60, what="regained")
    finally:
        c.stop()
    text = log.read_text()
    assert text.count("worker.broker_lost") == 1, text
    assert text.count("worker.ready") == 2, text


def test_weight_loading_shows_a_progress_bar_on_a_tty(cluster, tiny_target_dir):
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "spec_serve.tools.cli", "worker", "--target", str(tiny_target_dir),
                             "--device", "cpu", "--broker", cluster.backend, "--service", "tty"],
                            stdin=secondary, stdout=secondary, stderr=secondary, env={**os.environ, **ENV},
                            start_new_session=True)
    os.close(secondary)
    seen = b""
    try:
        deadline = time.monotonic() + 120
        while b"worker.loaded" not in seen and time.monotonic() < deadline:
            if select.select([primary], [], [], 1.0)[0]:
                try:
                    seen += os.read(primary, 65536)
                except OSError:  # the worker exited and closed the terminal
                    break
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        os.close(primary)
    assert b"Loading weights" in seen and b"100%" in seen, seen[-2000:]


# ----------------------------------------------------------------- defaults a GPU user expects


def test_device_and_dtype_defaults():
    assert device_and_dtype(None, None, cuda_available=True) == ("cuda", "bfloat16")
    assert device_and_dtype(None, None, cuda_available=False) == ("cpu", None)  # the checkpoint's dtype
    assert device_and_dtype("cuda:1", "float32", cuda_available=True) == ("cuda:1", "float32")
    assert device_and_dtype("cpu", None, cuda_available=True) == ("cpu", None)


def test_space_separated_layer_ids(cluster, tiny_target_dir):
    """The module's worker was started with ``--aux-layer-ids 1 3 4``."""
    with RemoteTargetModel(cluster.frontend, timeout=60, **CLIENT_KW) as target:
        assert target.target_info().aux_layer_ids == (1, 3, 4)
    assert join_int_lists(["--dspark-layer-ids", "-1", "3", "5", "--capacity", "3"]) == \
        ["--dspark-layer-ids", "-1,3,5", "--capacity", "3"]
    assert join_int_lists(["--aux-layer-ids", "1,15,28", "--service", "x"]) == \
        ["--aux-layer-ids", "1,15,28", "--service", "x"]


def _hub_cache(tmp_path: Path, target_dir: Path, repo: str) -> Path:
    """An HF_HOME whose hub cache holds ``target_dir`` as ``repo`` (models--org--name/snapshots/REV + refs/main)."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    entry = tmp_path / "hf" / "hub" / f"models--{repo.replace('/', '--')}"
    shutil.copytree(target_dir, entry / "snapshots" / revision)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(revision)
    return tmp_path / "hf"


def test_target_hub_id_from_an_offline_cache(cluster, tiny_target_dir, tmp_path, colocated_target):
    hf_home = _hub_cache(tmp_path, tiny_target_dir, "acme/tiny-llama")
    proc = cluster.start_worker("acme/tiny-llama", service="hub", env={"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"})
    try:
        cluster.wait_workers(1, service="hub", timeout=120)
        with RemoteTargetModel(cluster.frontend, service="hub", timeout=60, **CLIENT_KW) as target:
            info = target.target_info()
            assert info.model_name == "acme/tiny-llama"
            assert info.fingerprint == colocated_target().target_info().fingerprint
            inputs = sample_batch(tiny_target_dir, batch=2, seq=12, seed=5)
            assert_equal_batches(target.generate_batch(*inputs, kind="dspark"),
                                 colocated_target().generate_batch(*inputs, kind="dspark"))
    finally:
        kill(proc)


def _remote_code_target(tmp_path: Path, target_dir: Path) -> Path:
    """The tiny target re-declared as a model whose code ships with the checkpoint (auto_map)."""
    out = tmp_path / "remote-code"
    shutil.copytree(target_dir, out)
    (out / "configuration_acme.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass AcmeConfig(LlamaConfig):\n    model_type = 'acme-llama'\n")
    (out / "modeling_acme.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .configuration_acme import AcmeConfig\n\n\n"
        "class AcmeForCausalLM(LlamaForCausalLM):\n    config_class = AcmeConfig\n")
    config = json.loads((out / "config.json").read_text())
    config.update(model_type="acme-llama", architectures=["AcmeForCausalLM"],
                  auto_map={"AutoConfig": "configuration_acme.AcmeConfig",
                            "AutoModelForCausalLM": "modeling_acme.AcmeForCausalLM"})
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_trust_remote_code(cluster, tiny_target_dir, tmp_path, colocated_target, tiny_vocab_mapping):
    from spec_serve.engines.hf import HFTarget

    path = _remote_code_target(tmp_path, tiny_target_dir)
    refused = spec_serve("worker", "--target", str(path), "--device", "cpu", "--broker", cluster.backend,
                         env={"HF_MODULES_CACHE": str(tmp_path / "modules")})
    assert "--trust-remote-code" in error_line(refused)
    engine = HFTarget(path, trust_remote_code=True)
    assert type(engine.model).__name__ == "AcmeForCausalLM"
    engine.set_vocab_mapping(*tiny_vocab_mapping)
    inputs = sample_batch(tiny_target_dir, batch=2, seq=12, seed=6)
    assert_equal_batches(engine.generate_batch(*inputs), colocated_target().generate_batch(*inputs))


# ------------------------------------------------------------------------------------ operations


def _ready(cluster, service: str | None = None) -> int:
    return cluster.get("/ready" + (f"?service={service}" if service else ""))[0]


def _register_and_leave(cluster, service: str) -> None:
    """A raw peer registers as a worker of ``service`` (the cluster's target info), then goes silent."""
    info = cluster.get("/workers")[1]["workers"][0]["target_info"]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(cluster.backend)
    try:
        sock.send_multipart(control(WORKER_TAG, WorkerCommand.READY.value, service,
                                    header={"target_info": info, "capacity": 1}))
        wait_until(lambda: any(w["service"] == service for w in cluster.get("/workers")[1]["workers"]), timeout=30,
                   what=f"a worker of {service} registered")
    finally:
        sock.close()


def test_readiness_counts_a_service_while_a_client_uses_it(cluster, tiny_target_dir, tiny_vocab_mapping):
    """A worker of service `other` leaves: /ready is 503 while a client still uses `other` (/health stays 200:
    the broker is alive), then 200 once that client is gone, and `other` is forgotten at once (the old
    broker: 503 until an idle grace passed). The worker also shows --threads taking effect."""
    proc = cluster.start_worker(tiny_target_dir, "--threads", "3", service="other")
    cluster.wait_workers(1, service="other", timeout=120)
    log = (cluster.log_dir / f"worker{len(cluster.workers) - 1}.log").read_text()
    assert "worker.threads threads=3 source=--threads" in log, log
    wait_until(lambda: _ready(cluster) == 200, timeout=30, what="200 with workers for every service in use")
    # A client using `other` (heartbeating as often as this broker expects, or it is forgotten).
    user = RemoteTargetModel(cluster.frontend, service="other", timeout=60, **CLIENT_KW)
    user.set_vocab_mapping(*tiny_vocab_mapping)
    kill(proc)
    wait_until(lambda: _ready(cluster) == 503, timeout=30, what="503 after the worker left")
    # A positive event first: a service whose only worker left later than `other`'s, and that no client
    # uses, is forgotten; so the broker has judged `other` too, and only its client keeps it.
    _register_and_leave(cluster, "control")
    wait_until(lambda: "control" not in cluster.get("/workers")[1]["services"], timeout=30,
               what="the unused service forgotten")
    assert "other" in cluster.get("/workers")[1]["services"]
    assert _ready(cluster, "other") == 503 and _ready(cluster, "default") == 200
    assert cluster.get("/health")[0] == 200
    user.close()
    wait_until(lambda: _ready(cluster) == 200, timeout=30, what="200 once nobody uses `other`")
    assert "other" not in cluster.get("/workers")[1]["services"]


def test_threads_option_and_default(tmp_path, monkeypatch):
    share = ThreadShare(3)
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # its value before comes back after the test
    try:
        assert share.apply() == 3 and torch.get_num_threads() == 3 and os.environ["OMP_NUM_THREADS"] == "3"
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError):
        ThreadShare(0)
    assert is_worker_cmdline(["/venv/bin/python", "/venv/bin/spec-serve", "worker", "--target", "x"])
    assert is_worker_cmdline(["python", "-m", "spec_serve.tools.cli", "worker"])
    assert not is_worker_cmdline(["python", "-m", "spec_serve.tools.cli", "broker"])
    assert not is_worker_cmdline(["vim", "worker"])
    proc = tmp_path / "proc"
    for pid, args in {"10": ["spec-serve", "worker"], "11": ["python", "-m", "spec_serve.tools.cli", "worker"],
                      "12": ["spec-serve", "broker"], "13": []}.items():
        (proc / pid).mkdir(parents=True)
        (proc / pid / "cmdline").write_bytes(b"\0".join(a.encode() for a in args) + b"\0")
    assert local_workers(None, proc) == 2
    assert local_workers(None, tmp_path / "absent") == 1


def test_thread_share_counts_only_the_workers_of_the_same_broker(tmp_path):
    """Issue 23: a worker counted every spec-serve worker on the host (local_workers=9 with one of one's
    own): now only those serving its broker, as their command line, environment or --config file says.
    Another user's worker whose environment we cannot read is not counted."""
    ours, theirs = "tcp://10.0.0.1:5556", "tcp://10.9.9.9:5556"
    config = tmp_path / "worker.yaml"
    config.write_text(f"broker: {ours}\n")
    processes = {
        "20": (["spec-serve", "worker", "--broker", ours], None),
        "21": (["python", "-m", "spec_serve.tools.cli", "worker", f"--broker={ours}"], None),
        "22": (["spec-serve", "worker"], {"SPEC_SERVE_BROKER": ours}),
        "23": (["spec-serve", "worker", "--config", str(config)], {}),
        "24": (["spec-serve", "worker", "--broker", theirs], None),
        "25": (["spec-serve", "worker"], {"SPEC_SERVE_BROKER": theirs}),
        "26": (["spec-serve", "worker"], None),  # another user's: environment unreadable, broker unknown
        "27": (["spec-serve", "worker"], {}),  # the default broker
    }
    proc = tmp_path / "proc"
    for pid, (args, environ) in processes.items():
        (proc / pid).mkdir(parents=True)
        (proc / pid / "cmdline").write_bytes(b"\0".join(a.encode() for a in args) + b"\0")
        if environ is not None:
            (proc / pid / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in environ.items()))
    assert local_workers(ours, proc) == 4
    assert local_workers(theirs, proc) == 2
    assert local_workers("tcp://127.0.0.1:5556", proc) == 1
    assert local_workers(None, proc) == 8


def test_keygen_secret_is_private_and_authorize_copies_only_the_public_key(tmp_path):
    result = CliRunner().invoke(main, ["keygen", str(tmp_path / "keys"), "--name", "worker0",
                                       "--authorize", str(tmp_path / "keys" / "authorized")])
    assert result.exit_code == 0, result.output
    secret, public = tmp_path / "keys" / "worker0.key_secret", tmp_path / "keys" / "worker0.key"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    assert sorted(p.name for p in (tmp_path / "keys" / "authorized").iterdir()) == ["worker0.key"]
    assert not list((tmp_path / "keys").glob(".keygen-*"))  # no scratch left behind
    help_text = CliRunner().invoke(main, ["keygen", "--help"]).output
    for line in help_text.splitlines():
        if line.strip().startswith("spec-serve keygen"):
            assert "authorized" not in line.split("--authorize")[0], f"a secret key into the authorized dir: {line}"


def test_every_shim_response_is_json(cluster):
    request = urllib.request.Request(cluster.http_url + "/model_info", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=10)
    assert err.value.code == 405 and err.value.headers["Content-Type"] == "application/json"
    assert "error" in json.loads(err.value.read())
    # A request head too large, an unknown method, a path too long, a malformed request line.
    for line, status in ((b"GET / HTTP/1.1\r\nX-Long: " + b"a" * 70000, 431), (b"BREW /pot HTTP/1.1", 405),
                         (b"GET /" + b"a" * 5000 + b" HTTP/1.1", 414), (b"NONSENSE", 400)):
        with socket.create_connection(("127.0.0.1", cluster.http_port), timeout=10) as s:
            s.sendall(line + b"\r\n\r\n")
            reply = http.client.HTTPResponse(s)
            reply.begin()
            assert reply.status == status and reply.headers["Content-Type"] == "application/json"
            assert "error" in json.loads(reply.read())


def test_metrics_have_no_created_series(cluster):
    code, text = cluster.get("/metrics")
    assert code == 200 and "spec_serve_requests" in text
    assert "_created" not in text



def test_thread_share_follows_each_worker_cpu_affinity(tmp_path):
    """Issue 39 item 6: 8 workers of a 64-core node, each a Slurm task pinned to 8 cores of its own
    (--cpus-per-task=8), got one math thread each (its 8 cores over the 8 workers); now each core is split
    among the workers that may run on it. Unpinned workers still divide the node; a worker whose affinity
    cannot be read counts on every core."""
    broker = "tcp://10.0.0.1:5556"
    proc = tmp_path / "proc"

    def workers(affinities: dict[str, str | None]) -> Path:
        shutil.rmtree(proc, ignore_errors=True)
        for pid, cpus in affinities.items():
            (proc / pid).mkdir(parents=True)
            (proc / pid / "cmdline").write_bytes(b"\0".join([b"spec-serve", b"worker", b"--broker",
                                                             broker.encode()]) + b"\0")
            if cpus is not None:
                (proc / pid / "status").write_text(f"Name:\tspec-serve\nCpus_allowed_list:\t{cpus}\nVoluntary:\t1\n")
        return proc

    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    pinned = workers({str(100 + i): f"{8 * i}-{8 * i + 7}" for i in range(8)})
    assert default_threads(broker, pinned, cpus=parse_cpu_list("8-15")) == 8
    unpinned = workers({str(100 + i): "0-63" for i in range(8)})
    assert default_threads(broker, unpinned, cpus=parse_cpu_list("0-63")) == 8
    halves = workers({"100": "0-3", "101": "0-3", "102": "4-7", "103": "4-7"})
    assert default_threads(broker, halves, cpus=parse_cpu_list("0-3")) == 2
    unknown = workers({"100": "0-3", "101": None})
    assert default_threads(broker, unknown, cpus=parse_cpu_list("0-3")) == 2
    assert default_threads(broker, tmp_path / "absent", cpus=parse_cpu_list("0-5")) == 6


def test_thread_share_stays_within_the_cgroup_cpu_quota(tmp_path):
    """A container's CPU limit (cgroup v2 cpu.max, v1 cpu.cfs_quota_us; the smallest along the cgroup's
    ancestors) caps the share: a Kubernetes pod limited to 4 CPUs on a 64-core node runs 4 threads, not 64."""
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    pod = root / "kubepods" / "pod1"
    (pod / "worker").mkdir(parents=True)
    (pod / "cpu.max").write_text("800000 100000\n")
    (pod / "worker" / "cpu.max").write_text("400000 100000\n")
    (proc / "self" / "cgroup").write_text("0::/kubepods/pod1/worker\n")
    assert cgroup_cpus(root, proc / "self" / "cgroup") == 4.0
    assert default_threads(None, proc, cpus=parse_cpu_list("0-63"), cgroup=root) == 4
    (pod / "worker" / "cpu.max").write_text("max 100000\n")  # the pod's limit still holds
    assert default_threads(None, proc, cpus=parse_cpu_list("0-63"), cgroup=root) == 8
    v1 = root / "cpu,cpuacct" / "docker" / "abc"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("150000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    (proc / "self" / "cgroup").write_text("4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n0::/\n")
    assert cgroup_cpus(root, proc / "self" / "cgroup") == 1.5
    assert default_threads(None, proc, cpus=parse_cpu_list("0-63"), cgroup=root) == 1
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpus(root, proc / "self" / "cgroup") is None
    assert default_threads(None, proc, cpus=parse_cpu_list("0-63"), cgroup=root) == 64


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("url, says", [
    ("tcp://::1:5555", "tcp://[::1]:5555"),
    ("tcp://fe80::1%eth0:5555", "tcp://[fe80::1%eth0]:5555"),
    ("tcp://[::1]", "needs a port after the IPv6 address, e.g. tcp://[::1]:5555"),
    ("tcp://[broker]:5555", "brackets hold an IPv6 address"),
])
def test_ipv6_endpoints_without_brackets_fail_in_one_line(url, says):
    """Issue 39 item 5: an IPv6 address without brackets reached libzmq, which said only "No such device"."""
    with pytest.raises(ValueError) as err:
        RemoteTargetModel(url)
    assert says in str(err.value) and "\n" not in str(err.value)


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this host has no IPv6 loopback (::1)")
def test_ipv6_loopback_cluster_serves_bit_for_bit(tiny_target_dir, tiny_vocab_mapping, tmp_path):
    """Issue 39 item 5: a broker bound to tcp://[::1]:PORT, a worker and a client reaching it there (ZMQ_IPV6 in
    the one socket factory): served, equal to the colocated forward; protected mode counts ::1 as loopback."""
    reference = Reference(tiny_target_dir, tiny_vocab_mapping)
    cluster = Cluster.on_free_ports("::1", env=FAST_ENV, log_dir=tmp_path)
    try:
        assert cluster.frontend.startswith("tcp://[::1]:")
        cluster.start_broker()
        cluster.start_worker(tiny_target_dir)
        cluster.wait_workers(1)
        with RemoteTargetModel(cluster.frontend, timeout=60, **CLIENT_KW) as client:
            assert_equal_batches(client.generate_batch(*reference.batch(5), kind="dspark"),
                                 reference.expected(5, kind="dspark"))
    finally:
        cluster.stop()


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this host has no IPv6 loopback (::1)")
@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_http_shim_listens_on_ipv6_loopback(host):
    """--http-host ::1 (a probe on an IPv6-only pod network): the shim binds it, loopback in protected mode."""
    shim = HttpShim({"/health": lambda query: json_response(200, {"status": "ok"})}, host, 0).start()
    try:
        with urllib.request.urlopen(f"http://[::1]:{shim.port}/health", timeout=5) as r:
            assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}
    finally:
        shim.close()
