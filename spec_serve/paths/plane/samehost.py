"""The same-host data plane: a reply's bytes go through memory both processes map; ZeroMQ carries the rest.

When a client and a worker run on one host (equal ``sockets.local_host_key()``: boot id, network,
mount and pid namespaces) a GENERATE reply's tensors do not travel as frames. The worker copies them
into a *slot* it lends the client:

- ``cuda``: device memory opened by the client through CUDA IPC (``cuda_ipc``), when both sides use
  GPUs and the client sees the worker's GPU; the client copies device to device (or peer to peer);
- ``shm``: a POSIX shared-memory segment (``shm``) otherwise; a GPU worker page-locks it and copies
  device to host into it.

The data message still goes to the client's data socket with the worker's header unchanged (digests
and all), plus ``path: {plane: ...}`` (where the bytes lie) and a single payload frame: the safetensors header of
those bytes, checked as frames are. Frames remain the path across hosts, for other ops, when no slot
is free, and after any failure of the plane, which logs one line.

Lifetimes. A slot holds one reply at a time. Before writing a slot the worker bumps its generation
word in the control block (``shm.ControlBlock``) and names that generation in the reply. The client
copies the bytes into its own tensors, then checks the generation has not moved and sets the slot's
ack word to it. The worker lends a slot again only once:

- the client acked it, or
- the client's process is gone (pid and start time, looked at when a slot is needed), or
- the lease ran out (``lease_s``: a client alive but stuck), or
- the reply could not be delivered.

A client whose copy outlived its lease finds the generation moved: it drops those bytes and asks
again as frames, so it never returns bytes the worker may have overwritten. A killed client leaves
nothing behind (its mappings die with it; its slots go back when it is seen gone). Clients create
no segments; a worker unlinks its own, and a killed worker's are reaped (``shm.reap``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch

from spec_serve.paths.base import LentReply
from spec_serve.paths.plane import cuda_ipc, shm
from spec_serve.protocol import wire
from spec_serve.telemetry.logs import event
from spec_serve.transport.sockets import local_host_key

log = logging.getLogger("spec_serve.samehost")

# SPEC_SERVE_SAME_HOST_PLANE=0 turns the plane off on the side whose environment says so.
ENV = "SPEC_SERVE_SAME_HOST_PLANE"
DEFAULT_LEASE_S = 60.0
KINDS = ("shm", "cuda")
# Slots are allocated with headroom, so replies that vary a little in size reuse them.
_SLOT_ALIGN = 2 << 20
# Workers whose memory a client keeps mapped at once (least recently used ones are dropped first).
MAX_MAPPED_WORKERS = 64


def enabled(default: bool = True) -> bool:
    value = os.environ.get(ENV)
    return default if value is None else value != "0"


class PlaneError(RuntimeError):
    """A plane reply this client cannot read; ``lasting`` when retrying the plane would fail again."""

    def __init__(self, message: str, lasting: bool = False):
        super().__init__(message)
        self.lasting = lasting


# ------------------------------------------------------------------- worker side


@dataclasses.dataclass
class _Slot:
    index: int
    kind: str | None = None
    buffer: torch.Tensor | None = None  # uint8 over the whole slot
    segment: shm.Segment | None = None
    locator: dict[str, Any] | None = None  # what a client needs to find the buffer
    version: int = 0
    holder: shm.Owner | None = None  # the client it is lent to, until it comes back
    deadline: float = 0.0

    @property
    def size(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()


@dataclasses.dataclass
class Export:
    """One reply lent through the plane: its payload (the header frame), where its bytes lie, and the event
    after which they are written (None: already)."""

    frames: list[Any]
    descriptor: dict[str, Any]
    ready: torch.cuda.Event | None
    data: torch.Tensor  # the reply's bytes in the slot (uint8)
    _give_back: Callable[[], None]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def left(self) -> None:
        """Sent: the slot stays lent until the client acks it (``paths.base.Loan``)."""

    def dropped(self) -> None:
        """The reply was not delivered: the slot may be lent again at once."""
        self._give_back()


class WorkerPlane:
    """A worker's slots: lent to same-host clients, one reply each, taken back as the module doc says."""

    def __init__(self, device: torch.device, slots: int, lease_s: float):
        if slots < 1 or lease_s <= 0:
            raise ValueError("plane slots must be >= 1 and the lease > 0 seconds")
        self.device = torch.device(device)
        self.lease_s = float(lease_s)
        self.host_key = local_host_key()
        self.owner = shm.Owner.current()
        self._token = os.urandom(4).hex()
        self._gpu = cuda_ipc.gpu_uuid(self.device) if self.device.type == "cuda" else None
        self.ctl = shm.ControlBlock.create(self.owner.name(self._token, "ctl"), slots)
        self._slots = [_Slot(i) for i in range(slots)]
        self._lock = threading.Lock()
        self._closed = False
        self._busy_logged = False
        self.lent = 0
        self.reclaimed = 0

    @classmethod
    def start(cls, device: torch.device, slots: int, lease_s: float) -> WorkerPlane | None:
        """The plane, or None (frames only) when it is turned off or this host has no usable /dev/shm."""
        if not enabled():
            return None
        if not shm.available():
            event(log, logging.WARNING, "worker.plane_unavailable", error=f"{shm.SHM_DIR} missing or not writable")
            return None
        reaped = shm.reap()
        if reaped:
            event(log, logging.INFO, "worker.plane_reaped", segments=len(reaped))
        try:
            return cls(device, slots, lease_s)
        except OSError as e:
            event(log, logging.WARNING, "worker.plane_unavailable", error=e)
            return None

    def transport(self, offer: Any) -> tuple[str, shm.Owner] | None:
        """How the reply to a request that makes ``offer`` (its ``offers["plane"]``) may be lent: (kind, the
        client's process); None: frames.

        The offer is a peer's: anything malformed, or another host, means frames, never an error.
        """
        if not isinstance(offer, dict) or offer.get("host") != self.host_key:
            return None
        pid, start, gpus = offer.get("pid"), offer.get("start"), offer.get("gpus", [])
        if type(pid) is not int or type(start) is not int or not 0 < pid < 1 << 31 or start < 0 \
                or not isinstance(gpus, list):
            return None
        cuda = self._gpu is not None and self._gpu in gpus and pid != os.getpid()  # IPC needs two processes
        return ("cuda" if cuda else "shm"), shm.Owner(self.owner.pidns, pid, start)

    def export(self, offer: Any, tensors: Mapping[str, torch.Tensor],
               copy_stream: torch.cuda.Stream | None) -> Export | None:
        """Lend a slot holding ``tensors`` to the client that made ``offer``; None: send frames instead."""
        chosen = self.transport(offer)
        if chosen is None:
            return None
        kind, holder = chosen
        frame, placed = wire.layout(tensors)
        nbytes = max((end for *_, end in placed), default=0)
        try:
            lent = self._acquire(kind, nbytes, holder)
            if lent is None:
                return None
            slot, gen = lent
            # An acquired slot holds a buffer and its locator (_allocate).
            buffer, locator = cast(torch.Tensor, slot.buffer), cast("dict[str, Any]", slot.locator)
        except Exception as e:  # no memory for a slot: frames
            event(log, logging.WARNING, "worker.plane_fallback", kind=kind, bytes=nbytes, error=e)
            return None
        try:
            ready = self._write(buffer, placed, copy_stream)
        except Exception as e:
            self._give_back(slot.index, gen)
            event(log, logging.WARNING, "worker.plane_fallback", kind=kind, bytes=nbytes, error=e)
            return None
        self.lent += 1
        descriptor = {"kind": kind, "ctl": self.ctl.name, "slot": slot.index, "gen": gen, "nbytes": nbytes,
                      **locator}
        return Export([frame], descriptor, ready, buffer[:nbytes], lambda: self._give_back(slot.index, gen))

    def _acquire(self, kind: str, nbytes: int, holder: shm.Owner) -> tuple[_Slot, int] | None:
        with self._lock:
            if self._closed:
                return None
            now = time.monotonic()
            free = [s for s in self._slots if self._free(s, now)]
            if not free:
                if not self._busy_logged:  # one line per busy spell, not per reply
                    event(log, logging.INFO, "worker.plane_busy", slots=len(self._slots), client_pid=holder.pid)
                    self._busy_logged = True
                return None
            self._busy_logged = False
            fits = [s for s in free if s.kind == kind and s.size >= nbytes]
            slot = min(fits or free, key=lambda s: s.size)
            if not fits:
                self._allocate(slot, kind, nbytes)
            gen = self.ctl.bump(slot.index)
            slot.holder, slot.deadline = holder, now + self.lease_s
            return slot, gen

    def _free(self, slot: _Slot, now: float) -> bool:
        """Whether ``slot`` may be lent now; takes it back from a client that is gone or past its lease."""
        if slot.holder is None or self.ctl.acked(slot.index):
            slot.holder = None
            return True
        reason = "lease_expired" if now > slot.deadline else None if slot.holder.alive() else "client_gone"
        if reason is None:
            return False
        event(log, logging.INFO, "worker.plane_reclaimed", slot=slot.index, client_pid=slot.holder.pid, reason=reason)
        self.reclaimed += 1
        slot.holder = None
        self.ctl.ack(slot.index, self.ctl.gen(slot.index))  # given back; its bytes change only once lent again
        return True

    def _allocate(self, slot: _Slot, kind: str, nbytes: int) -> None:
        self._drop_buffer(slot)
        size = -(-max(nbytes, 1) * 9 // 8 // _SLOT_ALIGN) * _SLOT_ALIGN
        slot.version += 1
        if kind == "cuda":
            buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
            fields, companions = cuda_ipc.share(buffer)
            for path in companions:  # reaped with our segments if we are killed
                self.ctl.add_companion(path)
            slot.buffer, slot.locator = buffer, {"cuda": fields}
        else:
            segment = shm.Segment.create(self.owner.name(self._token, f"s{slot.index}v{slot.version}"), size)
            if self.device.type == "cuda":
                try:
                    segment.pin()
                except RuntimeError as e:  # pageable: slower device->host copies, still correct
                    event(log, logging.WARNING, "worker.plane_unpinned", segment=segment.name, error=e)
            slot.buffer, slot.segment, slot.locator = segment.data, segment, {"segment": segment.name}
        slot.kind = kind

    def _drop_buffer(self, slot: _Slot) -> None:
        if slot.buffer is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no copy may still write into it
        if slot.segment is not None:
            slot.segment.unlink()
            slot.segment.close()
        slot.buffer = slot.segment = slot.locator = slot.kind = None

    def _write(self, buffer: torch.Tensor, placed: list[tuple[str, torch.Tensor, int, int]],
               copy_stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        """Copy the tensors into ``buffer`` at their offsets: on ``copy_stream`` (returning its event) when a GPU
        is involved and every tensor is on that stream's device or the host, else synchronously (None)."""
        on_gpu = buffer.is_cuda or any(t.is_cuda for _, t, _, _ in placed)
        if copy_stream is not None and on_gpu and all(
                t.device in (copy_stream.device, torch.device("cpu")) for _, t, _, _ in placed):
            copy_stream.wait_stream(torch.cuda.current_stream(copy_stream.device))
            with torch.cuda.stream(copy_stream):
                for _, t, begin, end in placed:
                    if end > begin:
                        buffer[begin:end].view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
                        if t.is_cuda:
                            t.record_stream(copy_stream)  # the allocator must not reuse it before the copy ran
                ready = torch.cuda.Event()
                ready.record(copy_stream)
            return ready
        for _, t, begin, end in placed:
            if end > begin:
                buffer[begin:end].view(t.dtype).view(t.shape).copy_(t)
        if on_gpu:
            torch.cuda.synchronize(self.device)
        return None

    def lent_out(self) -> int:
        """Slots lent to clients and not yet back (acked, client gone, or lease over): a stopping worker
        waits for them before it unlinks their memory."""
        with self._lock:
            now = time.monotonic()
            return sum(not self._free(slot, now) for slot in self._slots)

    def _give_back(self, index: int, gen: int) -> None:
        with self._lock:
            if not self._closed:
                self.ctl.ack(index, gen)

    def close(self) -> None:
        """Free every slot and unlink every segment (clients mid-copy keep their mappings)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for slot in self._slots:
                self._drop_buffer(slot)
            shm.unlink_driver_files(self.ctl.companions(), self.owner.pid)
            self.ctl.segment.unlink()
            self.ctl.close()


# ------------------------------------------------------------------- client side


class _Span:
    """One reply tensor in a lent slot: copied out with ``copy_into``, never viewed in place (the worker
    writes the slot again once it is given back)."""

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], copy: Callable[[torch.Tensor], Any]):
        self.dtype, self.shape, self._copy = dtype, tuple(shape), copy

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n

    def view(self) -> None:
        return None

    def copy_into(self, out: torch.Tensor) -> torch.Tensor:
        if not (out.dtype == torch.uint8 and out.is_contiguous() and out.numel() == self.nbytes):
            raise ValueError(f"copy_into needs a contiguous uint8 tensor of {self.nbytes} elements")
        self._copy(out)
        return out.view(self.dtype).view(self.shape)


class PlaneReply(dict[str, _Span], LentReply):
    """A reply's tensors (``_Span``) in a slot the worker lent.

    Copy them out, then ``settle``: the slot goes back to the worker whatever happens; the result
    says whether the copies hold the bytes the worker lent (None) or a re-request must replace them.
    ``release`` gives the slot back without looking (the bytes were not used).
    """

    def __init__(self, spans: dict[str, _Span], request_id: bytes, ctl: shm.ControlBlock,
                 slot: int, gen: int, devices: set[torch.device],
                 resend: Callable[[str], concurrent.futures.Future[Any]]) -> None:
        super().__init__(spans)
        self.request_id = request_id
        self._ctl, self._slot, self._gen, self._devices, self._resend = ctl, slot, gen, devices, resend
        self._settled = False
        self._lock = threading.Lock()

    def settle(self) -> concurrent.futures.Future[Any] | None:
        """After copying the tensors out: None if they are intact, else the future of the request sent again."""
        if self._give_back() is not False:
            return None
        return self._resend(f"slot {self._slot} of {self._ctl.name} was lent again during the copy")

    def release(self) -> None:
        self._give_back()

    def _give_back(self) -> bool | None:
        """Ack the slot once; whether it still held our generation after the copies (None: acked before)."""
        with self._lock:
            if self._settled:
                return None
            self._settled = True
        for device in self._devices:  # copies out of the slot are queued on these streams
            torch.cuda.current_stream(device).synchronize()
        # Read before the ack: once acked, the worker may lend the slot again at once.
        intact = self._ctl.gen(self._slot) == self._gen
        self._ctl.ack(self._slot, self._gen)
        return intact


class ClientPlane:
    """A client's side of the plane: the offer its requests carry, and the worker memory it has mapped.

    Used from the client's I/O thread (``open``, ``tick``, ``close``); ``PlaneReply`` objects may be
    settled on any thread and keep what they read from alive themselves.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.owner = shm.Owner.current()
        self.gpus = cuda_ipc.visible_gpus() if self.device.type == "cuda" else {}
        self._controls: collections.OrderedDict[str, shm.ControlBlock] = collections.OrderedDict()
        self._slots: dict[tuple[str, int], tuple[str | None, Any]] = {}  # (ctl, slot) -> (locator, Segment | tensor)
        self.off_reason: str | None = None

    @classmethod
    def start(cls, device: torch.device, wanted: bool | None) -> ClientPlane | None:
        if not (enabled() if wanted is None else wanted) or not shm.available():
            return None
        return cls(device)

    def offer(self) -> dict[str, Any] | None:
        """What a request carries so a worker of this host may lend it a slot; None once the plane is off."""
        if self.off_reason is not None:
            return None
        return {"host": local_host_key(), "pid": self.owner.pid, "start": self.owner.start, "gpus": list(self.gpus)}

    def open(self, descriptor: Any, payload: list[Any], request_id: bytes,
             resend: Callable[[str], concurrent.futures.Future[Any]]) -> PlaneReply:
        """The reply whose bytes ``descriptor`` (its ``path["plane"]``) places; ``PlaneError`` if they cannot be
        read here."""
        d = _descriptor(descriptor)
        if len(payload) != 1:
            raise PlaneError(f"plane reply with {len(payload)} payload frames, expected its header frame alone")
        ctl = self._control(d["ctl"])
        if d["slot"] >= ctl.slots:
            raise PlaneError(f"slot {d['slot']} out of range for {ctl.name}")
        if ctl.gen(d["slot"]) != d["gen"]:
            raise PlaneError(f"slot {d['slot']} of {ctl.name} was lent again before the copy")
        if d["kind"] == "shm":
            spans, devices = self._shm_spans(d, payload[0])
        else:
            spans, devices = self._cuda_spans(d, payload[0])
        return PlaneReply(spans, request_id, ctl, d["slot"], d["gen"], devices, resend)

    def _shm_spans(self, d: dict[str, Any], header_frame: Any) -> tuple[dict[str, _Span], set[torch.device]]:
        segment = self._mapped(d, lambda: shm.Segment.open(d["segment"]))
        if d["nbytes"] > segment.size:
            raise PlaneError(f"plane reply of {d['nbytes']} bytes overruns {segment.name} ({segment.size} bytes)")
        try:
            spans, _ = wire.parse([header_frame, segment.memoryview()[: d["nbytes"]]])
        except wire.WireError as e:
            raise PlaneError(f"plane reply header: {e}") from None
        return {name: _Span(s.dtype, s.shape, s.copy_into) for name, s in spans.items()}, set()

    def _cuda_spans(self, d: dict[str, Any], header_frame: Any) -> tuple[dict[str, _Span], set[torch.device]]:
        key = repr(sorted(d["cuda"].items())) if isinstance(d["cuda"], dict) else ""
        buffer = self._mapped(d, lambda: cuda_ipc.open_shared(d["cuda"], self.gpus), key)
        if d["nbytes"] > buffer.numel():
            raise PlaneError(f"plane reply of {d['nbytes']} bytes overruns its CUDA buffer ({buffer.numel()} bytes)")
        try:
            layout, _ = wire.parse_header(header_frame, d["nbytes"])
        except wire.WireError as e:
            raise PlaneError(f"plane reply header: {e}") from None

        def copier(begin: int, end: int) -> Callable[[torch.Tensor], Any]:
            return lambda out: out.copy_(buffer[begin:end], non_blocking=True)

        spans = {name: _Span(dtype, shape, copier(begin, end)) for name, (dtype, shape, begin, end) in layout.items()}
        devices = {buffer.device} | ({self.device} if self.device.type == "cuda" else set())
        return spans, devices

    def _control(self, name: str) -> shm.ControlBlock:
        ctl = self._controls.get(name)
        if ctl is None:
            ctl = self._controls[name] = self._open(lambda: shm.ControlBlock.open(name))
            while len(self._controls) > MAX_MAPPED_WORKERS:
                self._forget([next(iter(self._controls))])
        self._controls.move_to_end(name)
        return ctl

    def _mapped(self, d: dict[str, Any], opener: Callable[[], Any], key: str | None = None) -> Any:
        """The slot's buffer, mapped once per (control block, slot, locator); a slot's old buffer is dropped."""
        key = key if key is not None else d.get("segment")
        cached = self._slots.get((d["ctl"], d["slot"]))
        if cached is not None and cached[0] == key:
            return cached[1]
        mapped = self._open(opener)
        self._slots[(d["ctl"], d["slot"])] = (key, mapped)
        return mapped

    def _open(self, opener: Callable[[], Any]) -> Any:
        try:
            return opener()
        except cuda_ipc.CudaIpcError as e:
            raise PlaneError(str(e), lasting=True) from None
        except shm.SegmentError as e:
            raise PlaneError(str(e), lasting=e.errno in (errno.EACCES, errno.EPERM)) from None
        except (OSError, ValueError) as e:
            raise PlaneError(f"cannot map the worker's memory: {e}") from None

    def failed(self, error: PlaneError) -> None:
        """Stop offering what failed for good: CUDA IPC (shared memory stays), or the whole plane."""
        if not error.lasting:
            return
        if self.gpus and "CUDA IPC" in str(error):
            self.gpus = {}
            event(log, logging.WARNING, "client.plane_cuda_off", error=error)
        else:
            self.off_reason = str(error)
            event(log, logging.WARNING, "client.plane_off", error=error)

    def release(self, descriptor: Any) -> None:
        """Give back a slot whose reply is not read (a duplicate, or one that failed to open)."""
        try:
            d = _descriptor(descriptor)
            ctl = self._control(d["ctl"])
            if d["slot"] < ctl.slots:
                ctl.ack(d["slot"], d["gen"])
        except PlaneError:
            pass

    def tick(self) -> None:
        """Forget the memory of workers that are gone, and reap their segments."""
        gone = [name for name in self._controls if not _owner_alive(name)]
        if gone:
            self._forget(gone)
            shm.reap()

    def _forget(self, controls: list[str]) -> None:
        """Drop the mappings of these workers' control blocks and slots (replies still being read keep
        theirs alive until they are settled)."""
        for name in controls:
            self._controls.pop(name, None)
        for key in [k for k in self._slots if k[0] in controls]:
            del self._slots[key]

    def close(self) -> None:
        self._controls.clear()
        self._slots.clear()
        shm.reap()


_DESCRIPTOR = {"kind": str, "ctl": str, "slot": int, "gen": int, "nbytes": int}


def _descriptor(d: Any) -> dict[str, Any]:
    """A peer's plane descriptor, checked: types, ranges, and the one locator its kind has."""
    if not isinstance(d, dict) or not all(type(d.get(k)) is t for k, t in _DESCRIPTOR.items()):
        raise PlaneError(f"plane descriptor must hold {sorted(_DESCRIPTOR)} with the right types")
    locator = "segment" if d["kind"] == "shm" else "cuda" if d["kind"] == "cuda" else None
    if locator is None or set(d) != {*_DESCRIPTOR, locator}:
        raise PlaneError(f"plane descriptor of kind {d['kind']!r} must name its buffer (and nothing else)")
    if d["slot"] < 0 or d["gen"] < 1 or d["nbytes"] < 0 or shm.owner_of(d["ctl"]) is None or \
            not d["ctl"].endswith(".ctl") or (locator == "segment" and shm.owner_of(str(d["segment"])) is None):
        raise PlaneError("plane descriptor out of range or naming no segment of this plane")
    return d


def lent_bytes(descriptor: Any) -> int:
    """The size a peer's plane descriptor claims for its bytes (0 if it claims none), for size limits."""
    nbytes = descriptor.get("nbytes") if isinstance(descriptor, dict) else None
    return nbytes if type(nbytes) is int and nbytes > 0 else 0


def _owner_alive(segment_name: str) -> bool:
    owner = shm.owner_of(segment_name)
    return owner is None or owner.alive()
