"""Ports picked, then bound by another process: free_port under SPEC_SERVE_PORT_RANGE (the suite's xdist processes
each pick from a range of their own, tests/conftest.py, so none picks a port another has picked and not yet bound);
where no range applies, a broker that finds its port taken exits with EXIT_ADDRESS_IN_USE and a cluster on ports it
picked itself starts it again on new ones."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import conftest
import pytest

from spec_serve.protocol.commands import EXIT_ADDRESS_IN_USE
from spec_serve.tools.launch import BrokerExited, Cluster, free_endpoints
from spec_serve.transport import sockets
from spec_serve.transport.sockets import PORT_RANGE_ENV, free_port


@pytest.fixture
def port_range(monkeypatch):
    def use(text: str) -> None:
        monkeypatch.setenv(PORT_RANGE_ENV, text)
        monkeypatch.setattr(sockets, "_port_cursor", {})

    return use


def test_picks_stay_in_the_range_and_move_on(port_range):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        lo = probe.getsockname()[1]
    port_range(f"{lo}-{lo + 7}")
    picks = [free_port() for _ in range(4)]
    assert all(lo <= p <= lo + 7 for p in picks) and len(set(picks)) == 4, picks  # moves on, none twice


def test_a_port_in_use_is_skipped_and_a_full_range_is_one_clear_error(port_range):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        port_range(f"{port}-{port}")
        with pytest.raises(RuntimeError, match=f"no free TCP port on 127.0.0.1 in {PORT_RANGE_ENV}={port}-{port}"):
            free_port()
        port_range(f"{port}-{port + 1}")
        assert free_port() == port + 1


@pytest.mark.parametrize("text", ["20000", "2-1", "0-10", "a-b", "70000-70001"])
def test_a_bad_range_says_what_to_give(port_range, text):
    port_range(text)
    with pytest.raises(ValueError, match="give LO-HI"):
        free_port()


def test_each_pytest_process_has_its_own_range():
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    if ephemeral_low < 32000:
        pytest.skip(f"the OS's own ports start at {ephemeral_low}: the suite's ranges do not fit below them")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) if worker.startswith("gw") else conftest.PORT_BLOCKS - 1
    lo, hi = sockets._port_range() or (0, 0)
    # This process's own block (an xdist process once kept its controller's: the same block for all of them).
    assert lo == conftest.PORT_BASE + index * conftest.PORT_BLOCK and hi - lo + 1 == 1000 and hi < ephemeral_low, \
        (worker, lo, hi)


@contextlib.contextmanager
def held(port: int):
    """Another process's listening socket on ``port`` (loopback), for as long as the block runs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        yield


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


@pytest.mark.parametrize("taken", ["frontend", "backend", "http-port"])
def test_a_broker_on_a_taken_port_exits_98_naming_it(taken):
    front, back, http = free_endpoints()
    port = {"frontend": _port(front), "backend": _port(back), "http-port": http}[taken]
    with held(port):
        done = subprocess.run([sys.executable, "-m", "spec_serve.tools.cli", "broker", "--frontend", front,
                               "--backend", back, "--http-port", str(http)], capture_output=True, text=True, timeout=60)
    print(done.stderr)
    assert done.returncode == EXIT_ADDRESS_IN_USE, done.stderr
    line, = done.stderr.strip().splitlines()
    assert f"--{taken}" in line and str(port) in line and "address already in use" in line


def test_a_cluster_on_free_ports_picks_again_when_its_broker_loses_one():
    cluster = Cluster.on_free_ports()
    taken = cluster.frontend
    try:
        with held(_port(taken)):
            cluster.start_broker()
        assert cluster.frontend != taken and cluster.get("/health")[0] == 200
        # Once served, the ports stay: a restart (workers know them) must not move.
        assert cluster.repick_host is None
    finally:
        cluster.stop()


def test_a_cluster_on_given_ports_reports_the_taken_port():
    cluster = Cluster(*free_endpoints())
    try:
        with held(_port(cluster.backend)), pytest.raises(BrokerExited) as exited:
            cluster.start_broker()
        assert exited.value.returncode == EXIT_ADDRESS_IN_USE
    finally:
        cluster.stop()
