"""Start and stop broker and worker processes: shared by the demo, benchmarks and tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, ClassVar, cast

from spec_serve.protocol.commands import EXIT_ADDRESS_IN_USE
from spec_serve.transport.sockets import free_port, tcp_endpoint

# How often a cluster on ports it picked itself picks new ones when its broker finds one of them taken.
PORT_ATTEMPTS = 5


def session_process(argv: Sequence[str], env: dict[str, str], out: int | IO[bytes]) -> subprocess.Popen:
    """``ARGV`` with its output to ``out``, in a new session: Ctrl-C in the parent's terminal reaches only the
    parent, which then shuts the children down in order."""
    return subprocess.Popen(list(argv), env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def python_process(argv: list[str], env: dict[str, str], out: int | IO[bytes]) -> subprocess.Popen:
    """``python ARGV`` as ``session_process`` starts it."""
    return session_process([sys.executable, *argv], env, out)


class BrokerExited(RuntimeError):
    """The broker process ended before its HTTP shim answered; ``returncode`` is its exit status."""

    def __init__(self, returncode: int):
        super().__init__(f"broker exited with {returncode}")
        self.returncode = returncode


def free_endpoints(host: str = "127.0.0.1") -> tuple[str, str, int]:
    """A frontend and a backend on ``host``, and an HTTP port on loopback (where the shim listens unless told
    otherwise), that nothing listens on now (free_port)."""
    return tcp_endpoint(host, free_port(host)), tcp_endpoint(host, free_port(host)), free_port()  # the shim: loopback


@dataclass
class Cluster:
    """A broker and its workers running as subprocesses on loopback."""

    # How a worker's ``python -m spec_serve.tools.cli worker ...`` starts (python_process's signature). The test
    # suite forks its workers from an interpreter that has imported torch already (tests/zygote.py).
    start_worker_process: ClassVar[Callable[[list[str], dict[str, str], int | IO[bytes]], subprocess.Popen]] = \
        staticmethod(python_process)

    frontend: str
    backend: str
    http_port: int
    broker: subprocess.Popen | None = None
    workers: list = field(default_factory=list)
    env: dict = field(default_factory=dict)
    log_dir: Path | None = None
    # Set by ``on_free_ports``: the host whose free ports this cluster picked, so that a broker that finds one taken
    # before it ever served (another process bound it between the pick and the bind) gets new ones.
    repick_host: str | None = None

    @classmethod
    def on_free_ports(cls, host: str = "127.0.0.1", **kwargs) -> Cluster:
        """A cluster on ports of ``host`` that nothing listens on now (``free_endpoints``), picked again if the
        broker loses one of them to another process before it starts (``start_broker``)."""
        return cls(*free_endpoints(host), repick_host=host, **kwargs)

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def get(self, path: str) -> tuple[int, dict | str]:
        """GET a shim route; returns (status, JSON body or text)."""
        try:
            with urllib.request.urlopen(self.http_url + path, timeout=5) as r:
                body = r.read().decode()
                code = r.status
        except urllib.error.HTTPError as e:
            body, code = e.read().decode(), e.code
        try:
            return code, json.loads(body)
        except json.JSONDecodeError:
            return code, body

    def start_broker(self, *extra: str) -> subprocess.Popen:
        """The broker, listening on the cluster's (loopback) endpoints: protected mode needs no keys there.

        On ports picked by ``on_free_ports``, and while no worker was told them, a broker that exits because one
        was taken (EXIT_ADDRESS_IN_USE) is started again on new ones, up to PORT_ATTEMPTS times."""
        attempt = 1
        while True:
            self.broker = self._spawn("broker", ["broker", "--frontend", self.frontend, "--backend", self.backend,
                                                 "--http-port", str(self.http_port), *extra])
            try:
                self.wait_http()
            except BrokerExited as e:
                if (e.returncode != EXIT_ADDRESS_IN_USE or self.repick_host is None or self.workers
                        or attempt == PORT_ATTEMPTS):
                    raise
                self.frontend, self.backend, self.http_port = free_endpoints(self.repick_host)
                attempt += 1
                continue
            self.repick_host = None  # served on these ports: a restart must keep them (workers know them)
            return self.broker

    def start_worker(self, target: str | Path, *extra: str, service: str = "default", env: dict | None = None,
                     command: Sequence[str] | None = None) -> subprocess.Popen:
        """A worker process; ``env`` adds to the cluster's environment (a None value unsets a variable),
        ``command`` replaces ``python -m spec_serve.tools.cli`` (e.g. another venv's ``spec-serve``). It runs on
        the CPU unless ``extra`` names a --device, as the colocated references here do (a worker alone
        picks a GPU when one is visible)."""
        device = () if "--device" in extra else ("--device", "cpu")
        proc = self._spawn(f"worker{len(self.workers)}", [
            "worker", "--target", str(target), "--broker", self.backend, "--service", service, *device, *extra],
            env=env, command=command)
        self.workers.append(proc)
        return proc

    def log_path(self, name: str) -> Path | None:
        """Where process ``name`` ("broker", "worker0", ...) logs, if the cluster keeps logs."""
        return None if self.log_dir is None else self.log_dir / f"{name}.log"

    def _spawn(self, name: str, args: Sequence[str], env: dict | None = None,
               command: Sequence[str] | None = None) -> subprocess.Popen:
        # Several CPU workers share this host's cores: one math thread each, or
        # OpenMP's spinning threads oversubscribe the cores and slow all by 10x.
        env = {"OMP_NUM_THREADS": "1", **os.environ, **self.env, **(env or {})}
        env = {k: v for k, v in env.items() if v is not None}  # None: unset it for this process
        out: int | IO[bytes] = subprocess.DEVNULL
        log_path = self.log_path(name)
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            out = open(log_path, "ab")
        if command is not None:
            return session_process([*command, *args], env, out)
        start = type(self).start_worker_process if name.startswith("worker") else python_process
        return start(["-m", "spec_serve.tools.cli", *args], env, out)

    def wait_http(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.broker is not None and self.broker.poll() is not None:
                raise BrokerExited(self.broker.returncode)
            try:
                self.get("/workers")
                return
            except OSError:
                time.sleep(0.1)
        raise TimeoutError("broker HTTP shim did not come up")

    def wait_workers(self, count: int, timeout: float = 120.0, service: str | None = None) -> None:
        """Wait until ``count`` workers (of ``service``) are registered."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in self.workers:
                if proc.poll() is not None and proc.returncode not in (0, -signal.SIGKILL, -signal.SIGTERM):
                    raise RuntimeError(f"a worker exited with {proc.returncode}")
            try:
                _, body = self.get("/workers")
                workers = [w for w in cast(dict, body)["workers"] if service is None or w["service"] == service]
                if len(workers) >= count:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{count} workers did not register within {timeout:g}s")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the workers (each leaves the broker's pool and exits), then the broker; a process still
        running after ``timeout`` seconds is killed."""
        deadline = time.monotonic() + timeout
        for group in (self.workers, [self.broker] if self.broker is not None else []):
            for p in group:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in group:
                try:
                    p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


@contextlib.contextmanager
def local_cluster(target: str | Path | None = None, workers: int = 2, *, worker_args: Sequence[str] = (),
                  broker_args: Sequence[str] = (), env: dict | None = None,
                  log_dir: Path | None = None, ready_timeout: float = 180.0) -> Iterator[Cluster]:
    """A broker plus ``workers`` hf workers of ``target`` on free loopback ports."""
    cluster = Cluster.on_free_ports(env=env or {}, log_dir=log_dir)
    try:
        cluster.start_broker(*broker_args)
        for _ in range(workers):
            cluster.start_worker(cast("str | Path", target), *worker_args)  # given whenever workers > 0
        if workers:
            cluster.wait_workers(workers, timeout=ready_timeout)
        yield cluster
    finally:
        cluster.stop()
