"""The cache directory: append-only segment files, each published whole by one rename (docs/cache.md).

Layout of ``DIR``::

    segments/<publish time, ns, 20 digits>-<writer>.seg   published: never written again, only deleted
    tmp/<writer>.<n>.partial                              being written by its one process; read by no other
    stats/<writer>.json                                   a closed client's counts (hits, misses, ...)

A segment is entries back to back (entry.py), then its index (per entry: key, offset, length, tokens),
then a trailer (magic, where the index starts, its count, its BLAKE2b). A process appends its rows to a
partial file of its own, and publishes it by renaming it into ``segments/`` once it holds
``segment_bytes``, is ``seal_after_s`` old, or the process closes the cache. So:

- no reader sees a partial entry: other processes see whole segments or nothing (one rename, atomic on
  local filesystems and NFS alike), and a process killed mid-write leaves a partial file nobody reads
  (``spec-serve cache prune`` removes stale ones);
- two processes writing the same row write two entries; a reader keeps the first it learnt of (its own,
  else the earliest published) and never switches, so a row it returned once it returns bit-equal again;
- many ranks on a shared filesystem make few large files and one directory listing per refresh, not a
  file per row.

Eviction (``max_bytes`` > 0): after each publish, whole segments are deleted oldest first (by publish
time) until the published segments hold at most ``max_bytes``.

Failures never stop training: a write that fails (full disk, quota, read-only ``DIR``) logs ONE warning
and turns writing off (what is there is still read); an entry that fails its digest, is torn or is of
another key is never returned: counted, logged once, and forgotten (a miss, fetched again).
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import hashlib
import json
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from spec_serve.cache import entry as entries
from spec_serve.telemetry.logs import event

log = logging.getLogger("spec_serve.cache")

SEGMENT_SUFFIX = ".seg"
PARTIAL_SUFFIX = ".partial"
INDEX_RECORD = struct.Struct("<16sQQI")  # key, offset, length, tokens
TRAILER = struct.Struct("<4sQQ16s")  # magic, index offset, count, BLAKE2b-128 of the index
TRAILER_MAGIC = b"SSCX"
DEFAULT_SEGMENT_BYTES = 256 << 20
DEFAULT_SEAL_AFTER_S = 30.0
REFRESH_EVERY_S = 2.0  # a miss looks for newly published segments at most this often
OPEN_SEGMENTS = 64  # file descriptors kept open for reading
IOV_MAX = 1024  # parts one writev takes (Linux)


@dataclasses.dataclass(frozen=True)
class Location:
    """Where an entry lies: its segment's file name (under ``segments/``, or this process's partial file
    under ``tmp/``), its offset and length there, and its row's token count."""

    segment: str
    offset: int
    length: int
    tokens: int


@dataclasses.dataclass
class StoreCounts:
    corrupt: int = 0  # entries that failed their checks: never returned, refetched
    unreadable: int = 0  # entries whose segment could not be read (deleted meanwhile, I/O error)
    written: int = 0
    written_bytes: int = 0
    read_bytes: int = 0
    published: int = 0
    evicted: int = 0


def read_index(path: Path) -> list[tuple[bytes, Location]]:
    """The entries a published segment lists (``ValueError`` for a segment whose trailer or index is bad)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < TRAILER.size:
            raise ValueError(f"{path.name}: {size} bytes, no trailer")
        magic, start, count, want = TRAILER.unpack(os.pread(f.fileno(), TRAILER.size, size - TRAILER.size))
        if magic != TRAILER_MAGIC or start + count * INDEX_RECORD.size != size - TRAILER.size:
            raise ValueError(f"{path.name}: bad trailer")
        index = os.pread(f.fileno(), count * INDEX_RECORD.size, start)
    if hashlib.blake2b(index, digest_size=16).digest() != want:
        raise ValueError(f"{path.name}: index fails its digest")
    records = [(key, Location(path.name, offset, length, tokens))
               for key, offset, length, tokens in INDEX_RECORD.iter_unpack(index)]
    if any(loc.offset + loc.length > start for _, loc in records):  # what a read allocates stays in the file
        raise ValueError(f"{path.name}: an index record points past the entries")
    return records


class Store:
    """One process's view of a cache directory; every method is safe from any thread."""

    def __init__(self, root: str | Path, *, max_bytes: int = 0, segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                 seal_after_s: float = DEFAULT_SEAL_AFTER_S):
        self.root = Path(root)
        self.segments, self.tmp, self.stats_dir = self.root / "segments", self.root / "tmp", self.root / "stats"
        self.max_bytes = max_bytes
        self.segment_bytes = min(segment_bytes, max(1 << 20, max_bytes // 4)) if max_bytes else segment_bytes
        self.seal_after_s = seal_after_s
        self.writer = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.counts = StoreCounts()
        self._lock = threading.RLock()
        self._index: dict[bytes, Location] = {}
        self._known: set[str] = set()  # published segments whose index we read (or could not)
        self._bad: set[Location] = set()
        self._fds: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._warned: set[str] = set()
        self._refreshed = 0.0
        self._partial: Path | None = None
        self._partial_fd: int | None = None
        self._partial_records: list[tuple[bytes, Location]] = []
        self._partial_size = 0
        self._partial_since = 0.0
        self._serial = 0
        self.writable = self._prepare()
        self.refresh(force=True)

    # ------------------------------------------------------------ reading

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def get(self, key: bytes, alloc: Callable[[int], torch.Tensor] | None = None) -> entries.Entry | None:
        """The checked entry of ``key``, or None (a miss: absent, or its entry failed a check). ``alloc(n)``:
        a CPU uint8 tensor of ``n`` bytes to read it into (pinned memory, for a GPU); else fresh bytes."""
        with self._lock:
            location = self._index.get(key)
            if location is None and time.monotonic() - self._refreshed > REFRESH_EVERY_S:
                self.refresh()
                location = self._index.get(key)
            if location is None:
                return None
            try:
                fd = os.dup(self._fd(location.segment))  # ours: eviction may close the shared one meanwhile
            except OSError as e:
                self._forget_segment(location.segment, e)
                return None
        try:
            data = _read_exactly(fd, location.length, location.offset, alloc)
            found = entries.decode(data, key)
        except OSError as e:
            with self._lock:
                self._forget_segment(location.segment, e)
            return None
        except entries.BadEntry as e:
            self._reject(key, location, str(e))
            return None
        finally:
            os.close(fd)
        with self._lock:
            self.counts.read_bytes += len(data)
        return found

    def reject(self, key: bytes, why: str) -> None:
        """The entry ``get`` returned for ``key`` is not its row after all (a foreign entry): never again."""
        with self._lock:
            location = self._index.get(key)
        if location is not None:
            self._reject(key, location, why)

    def _reject(self, key: bytes, location: Location, why: str) -> None:
        with self._lock:
            self.counts.corrupt += 1
            self._bad.add(location)
            if self._index.get(key) == location:
                del self._index[key]
            self.warn_once("corrupt", "cache.corrupt_entry", dir=self.root, segment=location.segment,
                            offset=location.offset, why=why, action="not returned, fetched again; further ones "
                            "are counted (spec-serve cache verify lists them)")

    def refresh(self, force: bool = False) -> None:
        """Learn the segments published since the last refresh (``force``: now, whatever the interval)."""
        with self._lock:
            if not force and time.monotonic() - self._refreshed < REFRESH_EVERY_S:
                return
            self._refreshed = time.monotonic()
            try:
                names = published(self.segments)
            except OSError:
                return
            for name in names:
                if name in self._known:
                    continue
                self._known.add(name)
                try:
                    records = read_index(self.segments / name)
                except (OSError, ValueError) as e:
                    self.counts.corrupt += 1
                    self.warn_once("corrupt", "cache.corrupt_segment", dir=self.root, segment=name, why=str(e),
                                    action="its entries are not used; further ones are counted")
                    continue
                for key, location in records:
                    if location not in self._bad:
                        self._index.setdefault(key, location)  # the first entry a process learns of stays

    def _fd(self, segment: str) -> int:
        fd = self._fds.get(segment)
        if fd is not None:
            self._fds.move_to_end(segment)
            return fd
        if self._partial is not None and segment == self._partial.name:
            assert self._partial_fd is not None
            return self._partial_fd
        fd = os.open(self.segments / segment, os.O_RDONLY)
        self._fds[segment] = fd
        while len(self._fds) > OPEN_SEGMENTS:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    def _forget_segment(self, segment: str, why: BaseException) -> None:
        """A segment that cannot be read (evicted by another process, an I/O error): its entries are misses."""
        self.counts.unreadable += 1
        self._index = {k: loc for k, loc in self._index.items() if loc.segment != segment}
        fd = self._fds.pop(segment, None)
        if fd is not None:
            os.close(fd)
        event(log, logging.DEBUG, "cache.segment_gone", segment=segment, why=why)

    # ------------------------------------------------------------ writing

    def put(self, key: bytes, data: bytes | Sequence[bytes | memoryview], tokens: int) -> None:
        """Append an entry of ``key`` (``entry.encode``'s bytes, or ``encode_parts``' parts), unless the key is
        known or writing is off."""
        parts = [data] if isinstance(data, (bytes, bytearray, memoryview)) else list(data)
        size = sum(memoryview(p).nbytes for p in parts)
        with self._lock:
            if not self.writable or key in self._index:
                return
            try:
                if self._partial_fd is None:
                    self._open_partial()
                assert self._partial is not None and self._partial_fd is not None
                _write_all(self._partial_fd, parts)
            except OSError as e:
                self._stop_writing(e)
                return
            location = Location(self._partial.name, self._partial_size, size, tokens)
            self._partial_size += size
            self._partial_records.append((key, location))
            self._index[key] = location
            self.counts.written += 1
            self.counts.written_bytes += size
            if (self._partial_size >= self.segment_bytes
                    or time.monotonic() - self._partial_since >= self.seal_after_s):
                self.publish()

    def publish(self) -> None:
        """Seal this process's partial file (its index and trailer) and rename it into ``segments/``."""
        with self._lock:
            if self._partial_fd is None or not self._partial_records:
                return
            assert self._partial is not None
            index = b"".join(INDEX_RECORD.pack(key, loc.offset, loc.length, loc.tokens)
                             for key, loc in self._partial_records)
            trailer = TRAILER.pack(TRAILER_MAGIC, self._partial_size, len(self._partial_records),
                                   hashlib.blake2b(index, digest_size=16).digest())
            name = f"{time.time_ns():020d}-{self.writer}.{self._serial}{SEGMENT_SUFFIX}"
            try:
                _write_all(self._partial_fd, [index + trailer])
                os.fsync(self._partial_fd)  # the bytes are on the server before the name appears (NFS)
                os.rename(self._partial, self.segments / name)
            except OSError as e:
                self._stop_writing(e)
                return
            self._fds[name] = self._partial_fd  # the same file, now published: read it through this fd
            for key, loc in self._partial_records:
                if self._index.get(key) == loc:
                    self._index[key] = dataclasses.replace(loc, segment=name)
            self._known.add(name)
            self.counts.published += 1
            self._partial, self._partial_fd, self._partial_records = None, None, []
            self._evict(keep=name)

    def _open_partial(self) -> None:
        self._serial += 1
        self._partial = self.tmp / f"{self.writer}.{self._serial}{PARTIAL_SUFFIX}"
        self._partial_fd = os.open(self._partial, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        self._partial_size, self._partial_since = 0, time.monotonic()

    def _evict(self, keep: str) -> None:
        """Oldest published segments first, until those left hold at most ``max_bytes`` (``keep`` stays)."""
        if not self.max_bytes:
            return
        for name in evict(self.segments, self.max_bytes, keep=keep):
            self.counts.evicted += 1
            self._forget_segment(name, FileNotFoundError(errno.ENOENT, "evicted", name))

    def _stop_writing(self, why: OSError) -> None:
        """Writing failed (full disk, quota, read-only): ONE warning, then no more writes; reads go on."""
        self.writable = False
        partial, fd = self._partial, self._partial_fd
        self._partial, self._partial_fd = None, None
        dropped = {loc for _, loc in self._partial_records}
        self._partial_records = []
        self._index = {k: loc for k, loc in self._index.items() if loc not in dropped}
        if fd is not None:
            os.close(fd)
        if partial is not None:
            try:
                partial.unlink()
            except OSError:
                pass
        self.warn_once("write", "cache.write_disabled", dir=self.root, why=f"{why.strerror or why}",
                        action="training goes on without storing new rows (rows already cached are still "
                               "read); free space or fix the directory's permissions, then restart")

    def _prepare(self) -> bool:
        """Create the layout; False (writing off, one warning) where the directory cannot be written."""
        try:
            for d in (self.segments, self.tmp, self.stats_dir):
                d.mkdir(parents=True, exist_ok=True)
            probe = self.tmp / f"{self.writer}.probe"
            probe.write_bytes(b"")
            probe.unlink()
            return True
        except OSError as e:
            self._stop_writing(e)
            return False

    def warn_once(self, what: str, name: str, **fields) -> None:
        if what not in self._warned:
            self._warned.add(what)
            event(log, logging.WARNING, name, **fields)

    # ------------------------------------------------------------ lifecycle

    def close(self, stats: dict | None = None) -> None:
        """Publish what this process wrote, record ``stats`` (stats/<writer>.json), close every file."""
        with self._lock:
            self.publish()
            if stats is not None and self.writable:
                try:
                    _publish_json(self.stats_dir / f"{self.writer}.json", stats)
                except OSError as e:
                    self._stop_writing(e)
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def published(segments: Path) -> list[str]:
    """The names of the published segments under ``segments``, oldest first (their names start with their
    publish time)."""
    return sorted(n for n in os.listdir(segments) if n.endswith(SEGMENT_SUFFIX))


def evict(segments: Path, max_bytes: int, keep: str | None = None) -> list[str]:
    """Delete published segments oldest first until the rest hold at most ``max_bytes``; their names."""
    sizes = []
    for name in published(segments):
        try:
            sizes.append((name, (segments / name).stat().st_size))
        except FileNotFoundError:
            continue  # evicted by another process meanwhile
    total, gone = sum(size for _, size in sizes), []
    for name, size in sizes:
        if total <= max_bytes:
            break
        if name == keep:
            continue
        try:
            (segments / name).unlink()
        except FileNotFoundError:
            pass
        total -= size
        gone.append(name)
    return gone


def _read_exactly(fd: int, length: int, offset: int,
                  alloc: Callable[[int], torch.Tensor] | None = None) -> memoryview:
    """``length`` bytes at ``offset`` (fewer where the file ends: a torn entry, which decode refuses), read
    into ``alloc(length)`` or a fresh buffer."""
    into = alloc(length) if alloc is not None else torch.empty(length, dtype=torch.uint8)  # not zeroed first
    buffer = memoryview(into.numpy().data)
    done = 0
    while done < length:
        n = os.preadv(fd, [buffer[done:]], offset + done)
        if not n:
            break
        done += n
    return buffer[:done]


def _write_all(fd: int, parts: Sequence[bytes | memoryview]) -> None:
    """Every byte of ``parts``, in order (``writev`` may write fewer bytes than asked, or fewer parts)."""
    views = [memoryview(p).cast("B") for p in parts if memoryview(p).nbytes]
    while views:
        written = os.writev(fd, views[:IOV_MAX])
        while views and written >= views[0].nbytes:
            written -= views[0].nbytes
            views.pop(0)
        if written:
            views[0] = views[0][written:]


def _publish_json(path: Path, value: dict) -> None:
    partial = path.with_suffix(PARTIAL_SUFFIX)
    partial.write_text(json.dumps(value))
    os.rename(partial, path)
