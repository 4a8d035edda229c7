"""PairGroup between real processes: gloo on CPU here, NCCL on two GPUs when present.

This file is also the peer program: the tests start ``python test_pairgroup.py
<peer> <device> <port|host> ...`` in a subprocess, which plays the other rank.
Both sides derive the tensors (and so the specs that would travel over ZeroMQ)
from a seed.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from spec_serve.paths.nccl.admit import filter_program
from spec_serve.paths.nccl.pairgroup import PairGroup, PairGroupError, _layout, _normalise, specs_of
from spec_serve.paths.nccl.worker import client_addresses

HOST = "127.0.0.1"
REPO = Path(__file__).resolve().parents[2]
# Forming a group waits for the peer's Python and torch to start: generous on 2
# shared cores. Waits that a test means to fail use OP_TIMEOUT.
JOIN_TIMEOUT = 60.0
OP_TIMEOUT = 3.0


def _mixed(seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Every dtype and shape kind a reply carries, small ones packed and large ones direct."""
    g = torch.Generator().manual_seed(seed)
    d = {
        "f32": torch.randn(3, 5 + seed % 3, generator=g),
        "bf16": torch.randn(4, 7, generator=g).to(torch.bfloat16),
        "i64": torch.randint(-(2**40), 2**40, (6,), generator=g),
        "mask": torch.rand(2, 3, 1, generator=g) > 0.5,
        "scalar": torch.tensor(seed * 1.5),
        "empty": torch.empty(0, 4, dtype=torch.float16),
        "u8": torch.randint(0, 256, (13,), dtype=torch.uint8, generator=g),
        "transposed": torch.randn(6, 8, generator=g).t(),
    }
    if seed % 2:
        # Over the 1 MiB direct-send threshold; one of them not contiguous.
        d["big_bf16"] = torch.randn(640, 1024, generator=g).to(torch.bfloat16)
        d["big_t"] = torch.randn(600, 512, generator=g).t()
    return {k: v.to(device) for k, v in d.items()}


def _big(i: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """A 32 MiB message, different for every i; built once, so a stream of them
    spends its time in transfers (where a kill should land)."""
    return {"hidden": _big_base(device), "ids": torch.arange(64, device=device) + i}


@functools.cache
def _big_base(device: str) -> torch.Tensor:
    return torch.arange(16 << 20, dtype=torch.float32, device=device).to(torch.bfloat16)


def _assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for name, t in expected.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name].cpu(), t.cpu()), name


@contextlib.contextmanager
def _peer(*args):
    """Run this file as the peer rank; SIGKILL it on the way out if still running."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen(
        [sys.executable, __file__, *map(str, args)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()


def _finish(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Wait for a peer that should end by itself, and check that it succeeded."""
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"peer exited with {proc.returncode}:\n{out}"


def _peer_port(proc: subprocess.Popen) -> int:
    """A peer that hosts the store reports its port first, as it would over ZeroMQ."""
    line = proc.stdout.readline()
    assert line.startswith("PORT "), line + proc.stdout.read()
    return int(line.split()[1])


def _kill_soon(proc: subprocess.Popen, delay: float = 0.05) -> list[float]:
    """SIGKILL ``proc`` from another thread (the caller is blocked in a transfer);
    the returned list receives the time of the kill."""
    killed_at: list[float] = []

    def kill() -> None:
        proc.kill()
        killed_at.append(time.monotonic())

    threading.Timer(delay, kill).start()
    return killed_at


def _assert_failed_in_time(killed_at: list[float], failure: pytest.ExceptionInfo, who: str) -> None:
    # A dead peer is usually seen at once (connection reset); otherwise the
    # operation's timeout ends the wait. Either way, within OP_TIMEOUT.
    elapsed = time.monotonic() - killed_at[0]
    print(f"{who} failed {elapsed:.2f} s after the kill: {str(failure.value)[:300]}")
    assert elapsed < OP_TIMEOUT + 5


def _round_trips(pg: PairGroup, n: int) -> None:
    """Send n mixed messages; the peer (``echo``) checks each and sends it back."""
    for i in range(n):
        sent = _mixed(i)
        pg.send_tensors(sent)
        if i % 3 == 2:
            # Into caller-owned tensors (large ones received in place).
            out = {k: torch.full_like(v.contiguous(), 7, device=pg.device) for k, v in sent.items()}
            back = pg.recv_tensors(specs_of(sent), out=out)
            assert back is out
        else:
            back = pg.recv_tensors(list(reversed(specs_of(sent))))
            assert all(t.device == pg.device for t in back.values())
        _assert_same(back, sent)


def _kill_sender_then_rebind_and_kill_receiver(
    bind_a: Callable[[], PairGroup], proc_a: subprocess.Popen, bind_b: Callable[[], PairGroup], proc_b: subprocess.Popen
) -> None:
    """Peer A streams 32 MiB messages and is killed mid-transfer; then peer B
    binds to the survivor with a fresh prefix, round-trips, and is killed while
    receiving. The survivor must fail within the timeout both times."""
    specs = specs_of(_big(0))
    pg = bind_a()
    for i in range(2):
        _assert_same(pg.recv_tensors(specs, timeout=30), _big(i))
    killed_at = _kill_soon(proc_a)
    with pytest.raises(PairGroupError) as failure:
        for i in range(2, 1_000_000):
            # Whatever is delivered before the failure must still be right.
            _assert_same(pg.recv_tensors(specs, timeout=OP_TIMEOUT), _big(i))
    _assert_failed_in_time(killed_at, failure, "receiver")
    assert pg.closed

    with bind_b() as pg:
        _round_trips(pg, 2)
        killed_at = _kill_soon(proc_b)
        with pytest.raises(PairGroupError) as failure:
            for i in range(1_000_000):
                pg.send_tensors(_big(i), timeout=OP_TIMEOUT)
        _assert_failed_in_time(killed_at, failure, "sender")


# --- in-process -------------------------------------------------------------


def test_layout_is_order_independent_aligned_and_splits_large_tensors():
    d = _mixed(1)
    a = _layout(_normalise(specs_of(d)))
    assert a == _layout(_normalise(reversed(specs_of(d))))
    assert all(offset % 64 == 0 for _, offset, _ in a.packed)
    assert [name for name, _, _ in a.direct] == ["big_bf16", "big_t"]
    assert a.total == sum(t.numel() * t.element_size() for t in d.values())
    other_dtype = _layout(_normalise([(n, s, torch.int32 if n == "f32" else t) for n, s, t in specs_of(d)]))
    assert other_dtype.total == a.total and other_dtype.digest != a.digest


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="rank"):
        PairGroup.create(HOST, 0, 2, device="cpu", prefix="x")
    with pytest.raises(ValueError, match="prefix"):
        PairGroup.create(HOST, 0, 0, device="cpu", prefix="")
    with pytest.raises(ValueError, match="duplicate"):
        _normalise([("a", (1,), torch.float32), ("a", (2,), torch.float32)])


def test_missing_peer_fails_within_timeout():
    start = time.monotonic()
    with pytest.raises(PairGroupError, match="could not form"):
        PairGroup.create(HOST, 0, 0, device="cpu", prefix="lonely", timeout=1.0)
    assert time.monotonic() - start < 10


def test_the_rendezvous_store_admits_only_its_client():
    """Issue 39 item 7: a bound worker's store takes connections from its client's address only (and its
    own); a stranger elsewhere (127.0.0.2 here) never connects, not even at TCP (its SYN is dropped), while
    the client forms the group and tensors round-trip bit for bit."""
    store, port = PairGroup.host_store(HOST, 0, JOIN_TIMEOUT, peers=client_addresses(f"tcp://{HOST}:9", HOST))
    stranger = socket.socket()
    try:
        stranger.bind(("127.0.0.2", 0))
        stranger.settimeout(1.0)  # its SYN is dropped, not refused: a connection would take microseconds here
        with pytest.raises(OSError):  # timed out: no connection, so no key listed, read or written
            stranger.connect((HOST, port))
    finally:
        stranger.close()
    with concurrent.futures.ThreadPoolExecutor(1) as client_thread:
        joined = client_thread.submit(PairGroup.create, HOST, port, 1, device="cpu", prefix="admitted",
                                      timeout=JOIN_TIMEOUT)
        worker = PairGroup.create(HOST, port, 0, device="cpu", prefix="admitted", store=store, timeout=JOIN_TIMEOUT)
        client = joined.result(JOIN_TIMEOUT)
        with worker, client:
            sent = _mixed(3)
            received = client_thread.submit(client.recv_tensors, specs_of(sent))
            worker.send_tensors(sent)
            _assert_same(received.result(JOIN_TIMEOUT), sent)


def test_client_addresses_are_those_of_its_data_endpoint():
    assert client_addresses("tcp://127.0.0.5:4000", "127.0.0.1") == ["127.0.0.5"]
    assert client_addresses("tcp://[::1]:4000", "::1") == ["::1"]
    assert client_addresses("ipc:///tmp/spec-serve-data", "10.0.0.7") == ["10.0.0.7"]  # on this host
    assert filter_program(socket.AF_INET, ["10.0.0.7"])[-2:] == [(0x06, 0, 0, 0), (0x06, 0, 0, 0xFFFFFFFF)]


# --- two processes, gloo ----------------------------------------------------


class _Server:
    """One long-lived peer that runs scenarios on request, each on a fresh
    binding of one store, so that the tests pay for its start-up once."""

    def __init__(self, proc: subprocess.Popen, store: dist.TCPStore, port: int):
        self.proc, self.store, self.port = proc, store, port

    def bind(self, prefix: str) -> PairGroup:
        return PairGroup.create(HOST, self.port, 0, device="cpu", prefix=prefix, store=self.store, timeout=JOIN_TIMEOUT)

    def start(self, *command) -> None:
        self.proc.stdin.write(" ".join(map(str, command)) + "\n")
        self.proc.stdin.flush()

    def finish(self) -> None:
        """Wait for the scenario to end; fail with the peer's output if it failed."""
        lines = []
        for line in self.proc.stdout:
            if line.startswith("DONE"):
                return
            lines.append(line)
            if line.startswith("FAIL"):
                break
        pytest.fail("peer scenario failed:\n" + "".join(lines))


@pytest.fixture(scope="module")
def server():
    store, port = PairGroup.host_store(HOST, 0, timeout=JOIN_TIMEOUT)
    with _peer("serve", "cpu", port) as proc:
        yield _Server(proc, store, port)


def test_round_trip_many_messages_both_directions(server):
    server.start("echo", "rt", 12)
    with server.bind("rt") as pg:
        _round_trips(pg, 12)
        assert pg._send_seq == pg._recv_seq == 12
    server.finish()


def test_desynchronised_receive_raises_and_never_delivers(server):
    x4 = [("x", (4,), torch.float32)]
    server.start("desync")

    # The peer sends 8 floats where 4 are expected: caught from the header,
    # before a too-small receive is posted (which would crash gloo's process).
    pg = server.bind("size")
    with pytest.raises(PairGroupError, match="nbytes 32 != expected 16"):
        pg.recv_tensors(x4, timeout=10)
    assert pg.closed
    with pytest.raises(PairGroupError, match="unusable"):
        pg.recv_tensors(x4)

    # The peer skips a sequence number, as if a message had been lost.
    pg = server.bind("seq")
    assert torch.equal(pg.recv_tensors(x4, timeout=10)["x"], torch.arange(4.0))
    with pytest.raises(PairGroupError, match="seq 2 != expected 1"):
        pg.recv_tensors(x4, timeout=10)

    # Same size, other dtype: only the spec digest tells them apart.
    pg = server.bind("digest")
    with pytest.raises(PairGroupError, match="digest"):
        pg.recv_tensors(x4, timeout=10)

    # Both sides wait to receive: a deadlock the timeout must break.
    pg = server.bind("silent")
    start = time.monotonic()
    with pytest.raises(PairGroupError, match="recv header failed"):
        pg.recv_tensors(x4, timeout=1.5)
    assert 1.0 < time.monotonic() - start < 5

    server.finish()


def test_peer_killed_mid_transfer_then_rebind():
    store, port = PairGroup.host_store(HOST, 0, timeout=JOIN_TIMEOUT)

    def bind(prefix: str) -> Callable[[], PairGroup]:
        return lambda: PairGroup.create(HOST, port, 0, device="cpu", prefix=prefix, store=store, timeout=JOIN_TIMEOUT)

    # B starts with A so that its start-up overlaps; it waits to join "kill-b".
    with _peer("stream", "cpu", port, "kill-a") as a, _peer("echo_then_sink", "cpu", port, "kill-b", 2) as b:
        _kill_sender_then_rebind_and_kill_receiver(bind("kill-a"), a, bind("kill-b"), b)


# --- two processes, NCCL (run on a 2-GPU machine) ------------------------------
# The worker (peer) is rank 0 on cuda:0 and hosts the store; the client (this
# process) is rank 1 on cuda:1.

needs_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


def _gpu_client(proc: subprocess.Popen, prefix: str) -> Callable[[], PairGroup]:
    return lambda: PairGroup.create(HOST, _peer_port(proc), 1, device="cuda:1", prefix=prefix, timeout=JOIN_TIMEOUT)


def _bandwidth_cases() -> list[tuple[str, list, int]]:
    # An EAGLE-3 compact reply for 4 x 2048 tokens of a Llama-8B-shaped target,
    # then single tensors of 16 and 256 MiB.
    b, s, h = 4, 2048, 4096
    compact = [
        ("aux_hidden_states", (b, s, 3 * h), torch.bfloat16),
        ("last_hidden_states", (b, s, h), torch.bfloat16),
        ("argmax", (b, s), torch.int64),
        ("input_ids", (b, s), torch.int64),
        ("loss_mask", (b, s), torch.int64),
    ]
    return [
        ("eagle3 compact 4x2048", compact, 10),
        ("16 MiB tensor", [("x", (8 << 20,), torch.bfloat16)], 50),
        ("256 MiB tensor", [("x", (128 << 20,), torch.bfloat16)], 10),
    ]


@pytest.mark.gpu
@needs_2_gpus
def test_nccl_round_trip_and_bandwidth():
    with _peer("echo_then_bandwidth", "cuda:0", "host", "gpu-rt", 6) as proc:
        with _gpu_client(proc, "gpu-rt")() as pg:
            _round_trips(pg, 6)
            for name, specs, reps in _bandwidth_cases():
                nbytes = sum(torch.Size(shape).numel() * dtype.itemsize for _, shape, dtype in specs)
                out = {n: torch.empty(shape, dtype=dtype, device=pg.device) for n, shape, dtype in specs}
                pg.recv_tensors(specs, out=out)  # warm-up
                torch.cuda.synchronize(pg.device)
                start = time.perf_counter()
                for _ in range(reps):
                    pg.recv_tensors(specs, out=out)
                torch.cuda.synchronize(pg.device)
                dt = (time.perf_counter() - start) / reps
                print(f"NCCL pair cuda:0 -> cuda:1, {name}: {nbytes / 2**20:.1f} MiB in {dt * 1e3:.3f} ms"
                      f" = {nbytes / dt / 1e9:.1f} GB/s")
                assert torch.equal(out[specs[0][0]], torch.ones(specs[0][1], dtype=specs[0][2], device=pg.device))
        _finish(proc)


@pytest.mark.gpu
@needs_2_gpus
def test_nccl_peer_killed_mid_transfer_then_rebind():
    with (_peer("stream", "cuda:0", "host", "gpu-kill-a") as a,
          _peer("echo_then_sink", "cuda:0", "host", "gpu-kill-b", 2) as b):
        _kill_sender_then_rebind_and_kill_receiver(_gpu_client(a, "gpu-kill-a"), a, _gpu_client(b, "gpu-kill-b"), b)


# --- peer programs -------------------------------------------------------------


def _peer_bind(device: str, port: str, prefix: str, store: dist.Store | None = None) -> PairGroup:
    if port == "host":
        store, bound = PairGroup.host_store(HOST, 0, timeout=JOIN_TIMEOUT)
        print(f"PORT {bound}", flush=True)
        return PairGroup.create(HOST, bound, 0, device=device, prefix=prefix, store=store, timeout=JOIN_TIMEOUT)
    return PairGroup.create(HOST, int(port), 1, device=device, prefix=prefix, store=store, timeout=JOIN_TIMEOUT)


def _echo(pg: PairGroup, n: int) -> None:
    for i in range(n):
        expected = _mixed(i)
        got = pg.recv_tensors(specs_of(expected))
        _assert_same(got, expected)
        pg.send_tensors(got)


def _peer_serve(device: str, port: str) -> None:
    """Run scenarios read from stdin, one binding each on one client store."""
    store = dist.TCPStore(HOST, int(port), world_size=2, is_master=False, timeout=timedelta(seconds=JOIN_TIMEOUT))
    for line in sys.stdin:
        scenario, *args = line.split()
        try:
            if scenario == "echo":
                prefix, n = args
                with _peer_bind(device, port, prefix, store) as pg:
                    _echo(pg, int(n))
            elif scenario == "desync":
                _desync(device, port, store)
            else:
                raise ValueError(f"unknown scenario {scenario!r}")
        except Exception as exc:
            print(f"FAIL {scenario}: {type(exc).__name__}: {exc}", flush=True)
        else:
            print(f"DONE {scenario}", flush=True)


def _desync(device: str, port: str, store: dist.Store) -> None:
    # Each send is expected to fail once the receiver has aborted its group.
    with contextlib.suppress(PairGroupError), _peer_bind(device, port, "size", store) as pg:
        pg.send_tensors({"x": torch.arange(8.0)}, timeout=10)
    with contextlib.suppress(PairGroupError), _peer_bind(device, port, "seq", store) as pg:
        pg.send_tensors({"x": torch.arange(4.0)})
        pg._send_seq += 1  # a sender that lost track of a message
        pg.send_tensors({"x": torch.arange(4.0)}, timeout=10)
    with contextlib.suppress(PairGroupError), _peer_bind(device, port, "digest", store) as pg:
        pg.send_tensors({"x": torch.arange(4, dtype=torch.int32)}, timeout=10)
    with contextlib.suppress(PairGroupError), _peer_bind(device, port, "silent", store) as pg:
        pg.recv_tensors([("x", (4,), torch.float32)], timeout=30)


def _peer_stream(device: str, port: str, prefix: str) -> None:
    pg = _peer_bind(device, port, prefix)
    for i in range(1_000_000):
        pg.send_tensors(_big(i, device), timeout=30)


def _peer_echo_then_sink(device: str, port: str, prefix: str, n: str) -> None:
    pg = _peer_bind(device, port, prefix)
    _echo(pg, int(n))
    specs = specs_of(_big(0))
    for _ in range(1_000_000):
        pg.recv_tensors(specs, timeout=30)


def _peer_echo_then_bandwidth(device: str, port: str, prefix: str, n: str) -> None:
    with _peer_bind(device, port, prefix) as pg:
        _echo(pg, int(n))
        for _, specs, reps in _bandwidth_cases():
            payload = {name: torch.ones(shape, dtype=dtype, device=device) for name, shape, dtype in specs}
            for _ in range(reps + 1):
                pg.send_tensors(payload)


if __name__ == "__main__":
    torch.set_num_threads(1)
    peer, *peer_args = sys.argv[1:]
    globals()[f"_peer_{peer}"](*peer_args)
