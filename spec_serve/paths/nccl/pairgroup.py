"""Private 2-rank process group between a worker and the one client bound to it.

When a training rank binds a worker for itself, supervision tensors go over a
process group of their own (NCCL GPU to GPU, or gloo CPU to CPU where CUDA is
absent) while control and metadata stay on ZeroMQ. The group is built from a
``TCPStore`` wrapped in a ``PrefixStore`` and a backend object constructed
directly: ``init_process_group`` is never called, because the trainer owns the
default group.

Wire format: every message is a fixed-size header, then the payload parts.

    header, 32 bytes (little endian), tag _HEADER_TAG
        magic   u32   _MAGIC
        version u32   _VERSION
        seq     u64   per-direction message counter, starting at 0
        nbytes  u64   bytes of all the tensors
        digest  u64   hash of the sorted (name, dtype, shape) list
    payload parts, tags _PAYLOAD_TAG + i, in this order:
        the tensors under _DIRECT_BYTES, sorted by name, packed into one flat
            uint8 buffer at 64-byte aligned offsets (one send for all of them);
        each larger tensor, sorted by name, sent from and into its own memory
            (packing a large tensor into the flat buffer would cost a copy
            that sending it from its own memory avoids).

The names, shapes and dtypes travel over ZeroMQ. The receiver checks magic,
version, seq, size and digest *before* it posts any payload receive, so a
desynchronised group raises :class:`PairGroupError` instead of delivering a
wrong tensor, and no receive is ever posted with a size the sender does not
send: gloo kills the whole process (``std::terminate`` from its I/O thread,
"Received data size doesn't match expected size") when a message is longer
than the posted buffer, and NCCL's behaviour on a size mismatch is undefined.
Distinct tags keep gloo from matching a part against another part's receive.

Any failure or timeout aborts the group: it cannot be resynchronised in place.
Bind again with a fresh prefix instead.
"""

from __future__ import annotations

import hashlib
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any, NamedTuple, NoReturn, Protocol, cast

import torch
import torch.distributed as dist

from spec_serve.paths.nccl.admit import admit_only

__all__ = ["PairGroup", "PairGroupError", "TensorSpec", "specs_of"]

TensorSpec = tuple[str, Sequence[int], torch.dtype]
_Spec = tuple[str, tuple[int, ...], torch.dtype]

_MAGIC = 0x31475053  # b"SPG1" read as little-endian u32
_VERSION = 1
_HEADER = struct.Struct("<IIQQQ")
_ALIGN = 64  # a multiple of every dtype's size, so each slice can be viewed as its dtype
# Tensors this large go in their own send: packing would cost a copy of each.
_DIRECT_BYTES = 1 << 20
# NCCL ignores tags (its p2p order is the send order); gloo matches on them.
_HEADER_TAG = 1
_PAYLOAD_TAG = 2
_ENV_LOCK = threading.Lock()


class PairGroupError(RuntimeError):
    """The pair group failed, timed out or lost sync; it has been aborted."""


def specs_of(tensors: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    """The (name, shape, dtype) list a receiver needs for ``tensors``."""
    return [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]


def _normalise(specs: Iterable[TensorSpec]) -> list[_Spec]:
    """Specs sorted by name, so sender and receiver agree whatever order they list them in."""
    out = []
    for name, shape, dtype in specs:
        if not isinstance(name, str):
            raise ValueError(f"tensor name must be a str, got {name!r}")
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{name}: dtype must be a torch.dtype, got {dtype!r}")
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"{name}: negative dimension in shape {shape}")
        out.append((name, shape, dtype))
    out.sort(key=lambda s: s[0])
    for a, b in zip(out, out[1:]):
        if a[0] == b[0]:
            raise ValueError(f"duplicate tensor name {a[0]!r}")
    return out


class _Layout(NamedTuple):
    packed: list[tuple[_Spec, int, int]]  # (spec, offset in the flat buffer, nbytes)
    packed_bytes: int
    direct: list[_Spec]
    total: int
    digest: int


def _layout(specs: list[_Spec]) -> _Layout:
    """Where each tensor goes in a message; a pure function of the sorted specs."""
    packed, direct = [], []
    offset = total = 0
    h = hashlib.blake2b(digest_size=8)
    for spec in specs:
        name, shape, dtype = spec
        h.update(f"{name}\0{dtype}\0{shape}\n".encode())
        nbytes = _nbytes(shape, dtype)
        total += nbytes
        if nbytes >= _DIRECT_BYTES:
            direct.append(spec)
        else:
            offset = -(-offset // _ALIGN) * _ALIGN
            packed.append((spec, offset, nbytes))
            offset += nbytes
    return _Layout(packed, offset, direct, total, int.from_bytes(h.digest(), "little"))


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def _view(buf: torch.Tensor, offset: int, nbytes: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return buf[offset : offset + nbytes].view(dtype).view(shape)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as flat uint8 (backends see bytes, never dtypes)."""
    return t.view(-1).view(torch.uint8)


def _check_out(specs: list[_Spec], out: Mapping[str, torch.Tensor]) -> None:
    """Each ``out[name]`` must be a tensor of its spec's shape and dtype."""
    for name, shape, dtype in specs:
        t = out.get(name)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
            got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t
            raise ValueError(f"out[{name!r}] must be a tensor of {shape} {dtype}, got {got}")


def _mismatch(got: tuple[int, ...], expected: tuple[int, ...]) -> str:
    """The header fields that differ from the expected ones, for the out-of-sync error."""
    return ", ".join(
        f"{field} {g:#x} != expected {e:#x}" if field in ("magic", "digest") else f"{field} {g} != expected {e}"
        for field, g, e in zip(("magic", "version", "seq", "nbytes", "digest"), got, expected)
        if g != e
    )


def _timedelta(seconds: float) -> timedelta:
    if not seconds > 0:
        raise ValueError(f"timeout must be positive, got {seconds!r}")
    return timedelta(seconds=seconds)


class _Backend(Protocol):
    """What a pair group uses of its torch backend, a ProcessGroupNCCL or ProcessGroupGloo (torch's stubs
    leave their point-to-point calls undeclared)."""

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int) -> dist.Work: ...

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int) -> dist.Work: ...

    def abort(self) -> None: ...


def _nccl_backend(store: dist.Store, rank: int, timeout: float) -> _Backend:
    # NVLink SHARP (NVLS) multicast must stay off on the shared GPU hosts.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    opts = dist.ProcessGroupNCCL.Options()
    # The watchdog's timeout is set well past ours: our bounded wait fires first
    # and aborts the group.
    opts._timeout = _timedelta(2 * timeout + 30)
    opts.is_high_priority_stream = False
    # ProcessGroupNCCL reads these in its constructor, per group; they are set
    # only while this group is built, so the trainer's own groups keep theirs.
    # Error handling 3 (SkipCleanUp, the default) lets the watchdog take the
    # whole process down about 60 s after any NCCL error on the group, a dead
    # peer included (seen on torch 2.11): fatal for a worker or a trainer that
    # outlives one binding. 2 (CleanUpOnly) aborts the group's communicators
    # and fails its work instead. The watchdog also waits (60 s on 2.11) for a
    # flight-recorder dump after an error; a rebinding stalled behind it.
    overrides = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0"}
    with _ENV_LOCK:
        saved = {key: os.environ.get(key) for key in overrides}
        os.environ.update(overrides)
        try:
            return cast(_Backend, dist.ProcessGroupNCCL(store, rank, 2, opts))
        finally:
            for key, value in saved.items():
                if value is None:
                    del os.environ[key]
                else:
                    os.environ[key] = value


def _gloo_backend(store: dist.Store, rank: int, timeout: timedelta, listen_host: str | None) -> _Backend:
    if listen_host is None:
        return cast(_Backend, dist.ProcessGroupGloo(store, rank, 2, timeout))
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # the stubs know only Options
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=listen_host)]
    opts._timeout = timeout
    return cast(_Backend, dist.ProcessGroupGloo(store, rank, 2, opts))


class PairGroup:
    """A private 2-rank group (rank 0 and rank 1) that moves named tensors.

    Not thread-safe: use one from one thread at a time. Every wait is bounded by
    ``timeout``; on any failure the group aborts and raises
    :class:`PairGroupError`, and every later call raises it too.
    """

    def __init__(self, backend: _Backend, store: dist.Store, rank: int, device: torch.device, timeout: float):
        self._pg: _Backend | None = backend
        self._store: dist.Store | None = store
        self.rank = rank
        self.peer = 1 - rank
        self.device = device
        self.timeout = timeout
        self._send_seq = 0
        self._recv_seq = 0
        # Reused so a steady stream of messages allocates (and page-faults) once.
        self._send_buf: torch.Tensor | None = None
        self._recv_buf: torch.Tensor | None = None
        self._error: str | None = None

    @staticmethod
    def host_store(host: str, port: int = 0, timeout: float = 30.0,
                   peers: Sequence[str] | None = None) -> tuple[dist.TCPStore, int]:
        """Host the rendezvous store on ``host`` only (port 0: any free port); returns (store, bound port).

        For the side that must tell its peer the port (over ZeroMQ) before both
        build the group; pass the store to :meth:`create` as ``store=``. A
        TCPStore binds every interface unless handed a listening socket: it is
        handed one bound to ``host`` (and owns it from then on). ``peers``: the
        only source addresses (besides ``host``) the store takes connections
        from (admit.py); None: any.
        """
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            if peers is not None:
                admit_only(listener, {host, *peers})
            listener.bind((host, port))
            listener.listen(128)
            port = listener.getsockname()[1]
        except BaseException:
            listener.close()
            raise
        store = dist.TCPStore(host, port, world_size=2, is_master=True, wait_for_workers=False,
                              timeout=_timedelta(timeout), master_listen_fd=listener.detach())
        return store, store.port

    @classmethod
    def create(
        cls,
        host: str,
        port: int,
        rank: int,
        *,
        device: torch.device | str,
        prefix: str,
        timeout: float = 30.0,
        store: dist.Store | None = None,
        listen_host: str | None = None,
    ) -> PairGroup:
        """Form the group: rank 0 hosts the store at ``host:port`` (0: any port), rank 1 connects.

        ``listen_host``: the local address this rank's gloo pair connections listen on (default: ``host``
        for rank 0, gloo's choice for rank 1); nothing listens on other interfaces. NCCL's bootstrap
        picks its own interface (``NCCL_SOCKET_IFNAME``).

        ``prefix`` must be unique per binding, so that a rebinding never reads a
        previous binding's keys. ``store`` reuses an existing store (from
        :meth:`host_store`, or a client store kept across bindings) instead of
        hosting or connecting. A CUDA ``device`` gives NCCL, anything else gloo.
        Blocks until the peer has joined (gloo) or at most ``timeout`` seconds.
        """
        if rank not in (0, 1):
            raise ValueError(f"rank must be 0 or 1, got {rank!r}")
        if not prefix:
            raise ValueError("prefix must be a non-empty, per-binding unique string")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        td = _timedelta(timeout)
        try:
            if store is None:
                if rank == 0:
                    store, _ = cls.host_store(host, port, timeout)
                else:
                    store = dist.TCPStore(host, port, world_size=2, is_master=False, timeout=td)
            prefixed = dist.PrefixStore(f"spec_serve/pair/{prefix}/", store)
            if device.type == "cuda":
                backend = _nccl_backend(prefixed, rank, timeout)
            else:
                backend = _gloo_backend(prefixed, rank, td, host if listen_host is None and rank == 0 else listen_host)
        except Exception as exc:
            raise PairGroupError(f"pair group {prefix!r} rank {rank}: could not form the group: {exc}") from exc
        return cls(backend, store, rank, device, timeout)

    @property
    def closed(self) -> bool:
        """True once the group was closed or aborted."""
        return self._pg is None

    def send_tensors(self, tensors: Mapping[str, torch.Tensor], dst_rank: int | None = None, *,
                     timeout: float | None = None) -> None:
        """Send ``tensors`` as one message; returns once every send has completed.

        The peer must call :meth:`recv_tensors` with the same (name, shape,
        dtype) set, in any order. Tensors may live on any device.
        """
        self._check_peer(dst_rank)
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")
        layout = _layout(_normalise(specs_of(tensors)))
        pg = self._live()
        deadline = self._deadline(timeout)
        header = self._header(self._send_seq, layout.total, layout.digest)
        parts = []
        if layout.packed_bytes:
            flat = self._send_buf = self._grow(self._send_buf, layout.packed_bytes)
            for (name, shape, dtype), offset, nbytes in layout.packed:
                _view(flat, offset, nbytes, shape, dtype).copy_(tensors[name].detach())
            parts.append(flat[: layout.packed_bytes])
        for name, _, _ in layout.direct:
            # No copy when the tensor is already contiguous on this device.
            parts.append(_bytes(tensors[name].detach().to(self.device).contiguous()))
        # All parts are posted before any wait, so the payload is already on its
        # way when the receiver has checked the header.
        works = [self._start("send header", pg.send, [header], self.peer, _HEADER_TAG)]
        for i, part in enumerate(parts):
            works.append(self._start("send payload", pg.send, [part], self.peer, _PAYLOAD_TAG + i))
        for work in works:
            self._wait(work, "send", deadline)
        self._send_seq += 1

    def recv_tensors(
        self,
        specs: Iterable[TensorSpec],
        src_rank: int | None = None,
        *,
        out: dict[str, torch.Tensor] | None = None,
        timeout: float | None = None,
    ) -> dict[str, torch.Tensor]:
        """Receive one message made of ``specs`` (name, shape, dtype), in any order.

        Without ``out``: returns new tensors on this group's device (the small
        ones are views of one shared buffer). With ``out``: fills ``out[name]``
        (each must exist with the spec's shape and dtype, on any device; large
        ones on this device are received into directly) and returns ``out``;
        after an error their contents are undefined. Raises
        :class:`PairGroupError` (and aborts) on timeout, peer failure or a
        header that does not match the expected seq, size or specs.
        """
        self._check_peer(src_rank)
        specs = _normalise(specs)
        if out is not None:
            _check_out(specs, out)
        layout = _layout(specs)
        pg = self._live()
        deadline = self._deadline(timeout)
        header = torch.empty(_HEADER.size, dtype=torch.uint8, device=self.device)
        self._wait(self._start("recv header", pg.recv, [header], self.peer, _HEADER_TAG), "recv header", deadline)
        got = _HEADER.unpack(bytes(header.tolist()))
        expected = (_MAGIC, _VERSION, self._recv_seq, layout.total, layout.digest)
        if got != expected:
            self._fail(f"recv: the message is not the one expected (group out of sync): {_mismatch(got, expected)}")

        flat, direct, parts = self._recv_targets(layout, out)
        works = [self._start("recv payload", pg.recv, [part], self.peer, _PAYLOAD_TAG + i)
                 for i, part in enumerate(parts)]
        for work in works:
            self._wait(work, "recv payload", deadline)
        self._recv_seq += 1

        result = {name: _view(flat, offset, n, shape, dtype) for (name, shape, dtype), offset, n in layout.packed}
        result.update(direct)
        if out is None:
            return result
        for name, t in result.items():
            if t is not out[name]:
                out[name].copy_(t)
        return out

    def _recv_targets(
        self, layout: _Layout, out: dict[str, torch.Tensor] | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[torch.Tensor]]:
        """Where the payload lands: the flat buffer of the small tensors, the large ones (``out``'s own
        where it is contiguous on this device), and the byte views received into, in payload order."""
        parts = []
        if out is None:
            flat = torch.empty(layout.packed_bytes, dtype=torch.uint8, device=self.device)
        else:
            flat = self._recv_buf = self._grow(self._recv_buf, layout.packed_bytes)
        if layout.packed_bytes:
            parts.append(flat[: layout.packed_bytes])
        direct = {}
        for name, shape, dtype in layout.direct:
            dst = None if out is None else out[name]
            if dst is None or dst.device != self.device or not dst.is_contiguous():
                dst = torch.empty(shape, dtype=dtype, device=self.device)
            direct[name] = dst
            parts.append(_bytes(dst))
        return flat, direct, parts

    def abort(self) -> None:
        """Tear the group down now, without waiting for the peer; idempotent."""
        self._error = self._error or "aborted"
        pg, self._pg = self._pg, None
        self._store = None
        self._send_buf = self._recv_buf = None
        if pg is None:
            return
        # abort() drops connections and fails pending work at once; a graceful
        # shutdown could wait on a peer that is gone.
        try:
            pg.abort()
        except Exception:  # nothing more can be done for a group being dropped
            pass

    def close(self) -> None:
        """Release the group and the store; idempotent."""
        self._error = self._error or "closed"
        self.abort()

    def __enter__(self) -> PairGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_pg", None) is not None:
            self.close()

    def _check_peer(self, rank: int | None) -> None:
        if rank is not None and rank != self.peer:
            raise ValueError(f"rank {self.rank} can only talk to rank {self.peer}, not {rank!r}")

    def _live(self) -> _Backend:
        if self._pg is None:
            raise PairGroupError(f"pair group is unusable ({self._error}): bind again with a fresh prefix")
        return self._pg

    def _grow(self, buf: torch.Tensor | None, nbytes: int) -> torch.Tensor:
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf

    def _header(self, seq: int, nbytes: int, digest: int) -> torch.Tensor:
        packed = bytearray(_HEADER.pack(_MAGIC, _VERSION, seq, nbytes, digest))
        return torch.frombuffer(packed, dtype=torch.uint8).to(self.device)

    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + _timedelta(self.timeout if timeout is None else timeout).total_seconds()

    def _start(self, what: str, post: Callable[..., dist.Work], *args: Any) -> dist.Work:
        try:
            return post(*args)
        except Exception as exc:
            self._fail(f"{what} failed: {type(exc).__name__}: {exc}", exc)

    def _wait(self, work: dist.Work, what: str, deadline: float) -> None:
        try:
            if self.device.type == "cuda":
                # Polled rather than wait(timeout): NCCL's timed wait sleeps in
                # steps of about a millisecond and, on timeout, goes through
                # the watchdog's tear-down path. Abort on our own deadline.
                pause = 1e-5
                while not work.is_completed():
                    if time.monotonic() > deadline:
                        raise TimeoutError("not completed in time")
                    time.sleep(pause)
                    pause = min(2 * pause, 1e-4)
                work.wait()  # raises the work's error; orders the current stream after it
            else:
                # At least a millisecond: a zero timedelta means "no timeout" to wait().
                left = timedelta(seconds=max(deadline - time.monotonic(), 1e-3))
                if work.wait(left) is False:  # some versions return False on timeout
                    raise TimeoutError("not completed in time")
        except Exception as exc:
            self._fail(f"{what} failed: {type(exc).__name__}: {exc}", exc)

    def _fail(self, msg: str, cause: BaseException | None = None) -> NoReturn:
        self._error = msg
        self.abort()
        raise PairGroupError(f"pair group rank {self.rank}: {msg}") from cause
