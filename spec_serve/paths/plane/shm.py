"""POSIX shared-memory segments of the same-host data plane: named after their owner, reaped once it died.

A segment is a file in ``/dev/shm`` named ``spec-serve.<pidns>.<pid>.<start>.<token>.<part>``: the
owner's pid namespace, pid and start time (``/proc/<pid>/stat``, so a reused pid is not mistaken for
the owner), a random token per plane, and the part (``ctl`` or a slot's data). Files are created
0600, so only processes of the same user can map them.

Ownership: the worker that creates a segment is the only one that unlinks it, when it replaces a
slot's buffer and when it stops. A worker killed with SIGKILL cannot: ``reap()`` removes every
segment whose owner is gone (and the files its CUDA IPC shares left, which the owner recorded in its
control block as companions). Workers reap when they start; clients when a worker whose segments they mapped has
died, and when they close. Segments of another pid namespace are never reaped: their pids mean
nothing here.

The control block (``ctl``) holds two words per slot, written by one side and read by the other:
``gen``, bumped by the worker each time it lends the slot, and ``ack``, set to that ``gen`` by the
client once its copy is done (or by the worker when it takes the slot back). Aligned 8-byte stores
and loads are atomic on the platforms torch supports.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import mmap
import os
import re
import warnings
from pathlib import Path

import numpy as np
import torch

SHM_DIR = Path("/dev/shm")
PREFIX = "spec-serve."
_NAME = re.compile(r"spec-serve\.(\d{1,20})\.(\d{1,10})\.(\d{1,20})\.([0-9a-f]{8})\.(ctl|s\d{1,4}v\d{1,9})")
# Files a CUDA IPC share leaves (cuda_ipc.py): torch's ref counters "/torch_<pid>_<random>_<n>" and the
# CUDA driver's interprocess-event file "/cuda.shm.<device>.<pid in hex>.<n>".
_TORCH_REF = re.compile(r"/torch_(\d{1,10})_\d{1,20}_\d{1,20}")
_CUDA_EVENT = re.compile(r"/cuda\.shm\.\d{1,4}\.([0-9a-f]{1,8})\.\d{1,9}")

_CTL_MAGIC = b"SPSCTL01"
_CTL_HEADER = 64
_COMPANION_BYTES = 64
_COMPANIONS = 4
_SLOTS_AT = _CTL_HEADER + _COMPANIONS * _COMPANION_BYTES
MAX_SLOTS = 1024


class SegmentError(OSError):
    """A segment that cannot be created, opened or trusted."""


@functools.cache
def pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def process_start(pid: int) -> int | None:
    """Start time of a live process (clock ticks since boot), or None if it is gone or a zombie."""
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            fields = f.read().rpartition(")")[2].split()  # the name before ")" may hold spaces
    except (OSError, ValueError):
        return None
    if not fields or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


@dataclasses.dataclass(frozen=True)
class Owner:
    """A process, as a pid namespace, pid and start time."""

    pidns: int
    pid: int
    start: int

    @classmethod
    def current(cls) -> Owner:
        pid = os.getpid()
        return cls(pid_namespace(), pid, process_start(pid) or 0)

    def alive(self) -> bool:
        """False only when this process is certainly gone (another namespace counts as alive)."""
        return self.pidns != pid_namespace() or process_start(self.pid) == self.start

    def name(self, token: str, part: str) -> str:
        return f"{PREFIX}{self.pidns}.{self.pid}.{self.start}.{token}.{part}"


def owner_of(name: str) -> Owner | None:
    """The owner a segment's name records; None for a name that is not a plane segment's."""
    m = _NAME.fullmatch(name)
    return Owner(int(m[1]), int(m[2]), int(m[3])) if m else None


class Segment:
    """One mapped segment; ``data`` is a uint8 tensor over all of it."""

    def __init__(self, name: str, mm: mmap.mmap):
        self.name = name
        self.size = len(mm)
        self._mm = mm
        with warnings.catch_warnings():  # a read-only mapping: its tensor is only ever read
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            self.data = torch.frombuffer(mm, dtype=torch.uint8)
        self._registered = False

    def memoryview(self) -> memoryview:
        return memoryview(self._mm)

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        path = _path(name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, max(size, 1))
            return cls(name, mmap.mmap(fd, max(size, 1)))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        finally:
            os.close(fd)

    @classmethod
    def open(cls, name: str, writable: bool = False) -> Segment:
        """Map an existing segment (read-only unless ``writable``); ``SegmentError`` if that fails."""
        try:
            fd = os.open(_path(name), os.O_RDWR if writable else os.O_RDONLY)
        except OSError as e:
            raise SegmentError(e.errno, f"cannot open shared-memory segment {name}: {e.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise SegmentError(f"shared-memory segment {name} is empty")
            return cls(name, mmap.mmap(fd, size, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)))
        finally:
            os.close(fd)

    def pin(self) -> None:
        """Page-lock the mapping for CUDA (device<->host copies at pinned speed); kept until ``close``."""
        if self.size and not self._registered:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(self.data.data_ptr(), self.size, 0))
            self._registered = True

    def close(self) -> None:
        """Unmap, once nothing else views the memory (until then garbage collection unmaps it)."""
        if self._registered:
            self._registered = False
            torch.cuda.cudart().cudaHostUnregister(self.data.data_ptr())
        self.data = None  # type: ignore[assignment]  # closed: drop the view of the unmapped memory
        with contextlib.suppress(BufferError):  # a view still alive elsewhere: unmapped when it goes
            self._mm.close()

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_path(self.name))


class ControlBlock:
    """The ``ctl`` segment of one plane: ``gen`` and ``ack`` words per slot, plus companion file names."""

    def __init__(self, segment: Segment):
        head = bytes(segment.data[:16].numpy())
        slots = int.from_bytes(head[8:16], "little")
        if head[:8] != _CTL_MAGIC or not 0 < slots <= MAX_SLOTS or segment.size < _SLOTS_AT + 16 * slots:
            raise SegmentError(f"{segment.name} is not a control block")
        self.segment = segment
        self.slots = slots
        self._words = segment.data[_SLOTS_AT : _SLOTS_AT + 16 * slots].numpy().view(np.uint64).reshape(slots, 2)

    @property
    def name(self) -> str:
        return self.segment.name

    @classmethod
    def create(cls, name: str, slots: int) -> ControlBlock:
        if not 0 < slots <= MAX_SLOTS:
            raise ValueError(f"slots must be in 1..{MAX_SLOTS}")
        segment = Segment.create(name, _SLOTS_AT + 16 * slots)
        segment.data[:16] = torch.frombuffer(bytearray(_CTL_MAGIC + slots.to_bytes(8, "little")), dtype=torch.uint8)
        return cls(segment)

    @classmethod
    def open(cls, name: str) -> ControlBlock:
        return cls(Segment.open(name, writable=True))

    def gen(self, slot: int) -> int:
        return int(self._words[slot, 0])

    def bump(self, slot: int) -> int:
        """Worker: lend ``slot`` anew; its new generation."""
        gen = int(self._words[slot, 0]) + 1
        self._words[slot, 0] = gen
        return gen

    def acked(self, slot: int) -> bool:
        return int(self._words[slot, 1]) == int(self._words[slot, 0])

    def ack(self, slot: int, gen: int) -> None:
        """The copy out of ``slot`` as lent at ``gen`` is done (a stale ``gen`` frees nothing)."""
        if int(self._words[slot, 0]) == gen:
            self._words[slot, 1] = gen

    def add_companion(self, path: str) -> None:
        """Record a file of the owner's that ``reap`` removes with its segments (cuda_ipc.share's files)."""
        raw = path.encode()
        if len(raw) >= _COMPANION_BYTES or path in self.companions():
            return
        for i in range(_COMPANIONS):
            at = _CTL_HEADER + i * _COMPANION_BYTES
            if not self.segment.data[at]:
                self.segment.data[at : at + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                return

    def companions(self) -> list[str]:
        area = bytes(self.segment.data[_CTL_HEADER:_SLOTS_AT].numpy())
        names = (area[i : i + _COMPANION_BYTES].split(b"\0", 1)[0] for i in range(0, len(area), _COMPANION_BYTES))
        return [n.decode(errors="replace") for n in names if n]

    def close(self) -> None:
        self._words = None  # type: ignore[assignment]  # closed: drop the view of the segment
        self.segment.close()


def reap() -> list[str]:
    """Unlink every plane segment (and recorded companion file) whose owner, in our pid namespace, is gone."""
    try:
        names = sorted(n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX))
    except OSError:
        return []
    reaped = []
    for name in names:
        owner = owner_of(name)
        if owner is None or owner.pidns != pid_namespace() or owner.alive():
            continue
        if name.endswith(".ctl"):
            _reap_companions(name, owner)
        with contextlib.suppress(OSError):
            os.unlink(SHM_DIR / name)
            reaped.append(name)
    return reaped


def _reap_companions(ctl_name: str, owner: Owner) -> None:
    """The CUDA IPC files of a dead worker: only names of that pid, and only if no process has that pid now
    (torch and the driver name their files by pid alone)."""
    if process_start(owner.pid) is not None:
        return
    try:
        ctl = ControlBlock.open(ctl_name)
    except (OSError, ValueError):
        return
    try:
        _unlink_companions(ctl.companions(), owner.pid)
    finally:
        ctl.close()


def companion_pid(path: str) -> int | None:
    """The pid a companion file's name records, or None for a name that is not one."""
    m = _TORCH_REF.fullmatch(path)
    if m:
        return int(m[1])
    m = _CUDA_EVENT.fullmatch(path)
    return int(m[1], 16) if m else None


def unlink_driver_files(paths: list[str], pid: int) -> None:
    """Unlink the CUDA driver's event files among ``paths`` that belong to ``pid`` (a worker closing its
    plane: the driver leaves them behind even at a normal exit; torch removes its own file then)."""
    _unlink_companions([path for path in paths if _CUDA_EVENT.fullmatch(path)], pid)


def _unlink_companions(paths: list[str], pid: int) -> None:
    """Unlink the companion files among ``paths`` (``/name``, under SHM_DIR) whose names record ``pid``."""
    for path in paths:
        if companion_pid(path) == pid:
            with contextlib.suppress(OSError):
                os.unlink(SHM_DIR / path.lstrip("/"))


def available() -> bool:
    """Whether this host has what the plane needs: a writable /dev/shm, and /proc to tell who is alive."""
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK) and os.path.exists("/proc/self/stat")


def _path(name: str) -> Path:
    if not _NAME.fullmatch(name):
        raise SegmentError(f"{name[:80]!r} is not a shared-memory segment name of this plane")
    return SHM_DIR / name


def unlink_own_companions() -> None:
    """The files our CUDA IPC shares left in /dev/shm (torch's ref counters, the driver's event file): torch
    removes its own at a normal exit, which ``os._exit`` skips (the plane was closed already)."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    _unlink_companions(["/" + name for name in names], os.getpid())
