"""The cache in front of a client: each batch's rows are looked up, only the missing rows are asked for
(one smaller batch, through the client's ordinary path: sharding, prefetch and every reply path as
without a cache), and the missing rows are stored once they arrive.

A batch's life (``CacheFront.generate``): on the caller's thread, its keys (rows.py) and a copy of its
inputs; on a cache thread, the hits read and checked (a bad entry is a miss); the missing rows sent as
one request of the stored kind (compact EAGLE-3, or DSpark); once it lands, every row placed in the
caller's order and padding on the client's device, positions past a row's span zero (as packed
replies, docs/packing.md), ``input_ids`` and ``loss_mask`` the caller's own (shifted for EAGLE-3), and
an EAGLE-3 batch expanded with the current vocab mapping exactly as a compact reply is (compact.py).
Then the batch resolves, and its new rows go to the writer thread.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from spec_serve.cache import entry as entries
from spec_serve.cache.rows import (
    STORED,
    check_row,
    decode_row,
    encode_row,
    key_prefix,
    normalize_rows,
    row_key,
    row_spans,
    stored_kind,
)
from spec_serve.cache.store import Store
from spec_serve.supervision.contract import (
    RESPONSE_TENSORS,
    Kind,
    TargetInfo,
    model_dtype,
    reply_specs,
    validate_request,
)
from spec_serve.supervision.eagle3 import shift_left

COMPACT = Kind.EAGLE3_COMPACT.value
READ_THREADS = 4  # batches whose hits are read (and checked) at once
MAX_PENDING_WRITE_BYTES = 1 << 30  # rows waiting for the writer thread; past this, new batches wait


@dataclasses.dataclass
class CacheStats:
    """What a cache counts (``RemoteTargetModel.cache.stats``); also written to ``DIR/stats/`` on close."""

    hits: int = 0  # rows read from the cache
    misses: int = 0  # rows asked for (absent, or their entry failed a check)
    uncacheable: int = 0  # rows not right-padded: always asked for, never stored
    hit_tokens: int = 0
    miss_tokens: int = 0
    batches: int = 0
    batches_all_hits: int = 0  # batches that sent no request
    stored: int = 0  # rows handed to the store

    @property
    def hit_rate(self) -> float:
        rows = self.hits + self.misses
        return self.hits / rows if rows else 0.0


class Expansion(Protocol):
    """How the client expands a compact EAGLE-3 batch (``spec_serve.client.compact.Expansion``)."""

    def later(self, parts: Any, kinds: list, rows: list, out: concurrent.futures.Future) -> None: ...


@dataclasses.dataclass(frozen=True)
class Upstream:
    """What the cache uses of its client: its target, its ordinary (uncached) batch path, the expansion of
    compact EAGLE-3 with the current mapping (RuntimeError without one), its device and prefetch depth, and
    what counts the caller's time blocked for a prefetch credit as waiting (its demand meter)."""

    target_info: Callable[[], TargetInfo]
    send: Callable[..., concurrent.futures.Future]
    expansion: Callable[[], Expansion]
    device: torch.device
    prefetch_depth: int
    waiting: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


@dataclasses.dataclass
class _Batch:
    kind: Kind
    stored: Kind
    info: TargetInfo
    input_ids: torch.Tensor  # CPU copies: the caller may refill its tensors once generate returns
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    spans: list[int | None]
    keys: list[bytes | None]
    expand: Expansion | None
    out: concurrent.futures.Future


class CacheFront:
    """The supervision cache of one client (``RemoteTargetModel(cache=DIR)``)."""

    def __init__(self, store: Store, upstream: Upstream, codec: str = "native"):
        self.store, self.up, self.codec = store, upstream, codec
        self.stats = CacheStats()
        self._lock = threading.Lock()
        self._credits = threading.BoundedSemaphore(upstream.prefetch_depth)
        self._readers = concurrent.futures.ThreadPoolExecutor(READ_THREADS, thread_name_prefix="spec-serve-cache")
        self._rows = concurrent.futures.ThreadPoolExecutor(READ_THREADS, thread_name_prefix="spec-serve-cache-row")
        # A GPU client reads entries into pinned memory, copied to the device without staging.
        self._alloc = _pinned if upstream.device.type == "cuda" else None
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="spec-serve-cache-write")
        # One batch's missing rows go to the client at a time (its request preparation is the caller's
        # thread's without a cache; NCCL binds lazily there).
        self._send_lock = threading.Lock()
        self._pending = threading.Condition()
        self._pending_bytes = 0
        # Rows handed to the writer and not yet in the store, in their stored form (on the host once their
        # copy's event completed): hits already.
        self._unwritten: dict[bytes, tuple[dict[str, torch.Tensor], Any]] = {}
        # A GPU client's new rows leave the device on a stream of their own, off the batch's critical path.
        self._copies = torch.cuda.Stream(upstream.device) if upstream.device.type == "cuda" else None

    @classmethod
    def open(cls, directory: Any, upstream: Upstream, *, max_bytes: int = 0, codec: str = "native") -> CacheFront:
        """The cache of ``directory`` (created if need be; unwritable: read only, one warning)."""
        return cls(Store(directory, max_bytes=max_bytes), upstream, codec)

    def keys(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, kind: str | Kind) -> list[bytes | None]:
        """The key of each row of a batch of ``kind`` (None: not cacheable)."""
        return self._keys(self.up.target_info(), stored_kind(Kind.parse(kind)), input_ids, row_spans(attention_mask))

    def _keys(self, info: TargetInfo, stored: Kind, input_ids: torch.Tensor,
              spans: Sequence[int | None]) -> list[bytes | None]:
        prefix = key_prefix(info, stored, self.codec)
        ids = input_ids.to("cpu")
        return [None if n is None else row_key(prefix, ids[i, :n]) for i, n in enumerate(spans)]

    def generate(self, input_ids, attention_mask, loss_mask, kind: str | Kind = "eagle3") -> concurrent.futures.Future:
        """``RemoteTargetModel.generate_batch_async`` through the cache; blocks while ``prefetch_depth``
        batches are in flight."""
        kind = Kind.parse(kind)
        info = self.up.target_info()
        validate_request(input_ids, attention_mask, loss_mask, info.vocab_size)
        expand = self.up.expansion() if kind is Kind.EAGLE3 else None  # the mapping of the moment it is asked
        ids, mask, loss = (t.to("cpu", copy=True) for t in (input_ids, attention_mask, loss_mask))
        stored, spans = stored_kind(kind), row_spans(mask)
        batch = _Batch(kind, stored, info, ids, mask, loss, spans, self._keys(info, stored, ids, spans), expand,
                       concurrent.futures.Future())
        with self.up.waiting():
            self._credits.acquire()
        batch.out.add_done_callback(lambda _: self._credits.release())
        self._readers.submit(self._guarded, batch, self._look_up, batch)
        return batch.out

    def _guarded(self, batch: _Batch, step: Callable[..., None], *args: Any) -> None:
        try:
            step(*args)
        except BaseException as e:
            if not batch.out.done():
                batch.out.set_exception(e)

    def _look_up(self, batch: _Batch) -> None:
        """Read the hits (the rows at once, on the row threads); send the rest as one request (nothing when
        every row hit)."""
        read = list(self._rows.map(lambda i: self._read(batch, i), range(len(batch.keys))))
        hits = {i: row for i, row in enumerate(read) if row is not None}
        missing = [i for i in range(len(batch.keys)) if i not in hits]
        self._count(batch, hits, missing)
        if not missing:
            self._finish(batch, hits, missing, None)
            return
        rows = torch.tensor(missing)
        with self._send_lock:
            sent = self.up.send(batch.input_ids[rows], batch.attention_mask[rows], batch.loss_mask[rows],
                                batch.stored.value)
        sent.add_done_callback(lambda f: self._readers.submit(self._guarded, batch, self._landed, batch, hits,
                                                              missing, f))

    def _read(self, batch: _Batch, i: int) -> dict[str, torch.Tensor] | None:
        """Row ``i``'s tensors (``[L, ...]``, CPU: pinned for a GPU client) if the cache holds it, else None."""
        key = batch.keys[i]
        if key is None:
            return None
        dtype, hidden = model_dtype(batch.info), batch.info.hidden_size
        with self._pending:
            unwritten = self._unwritten.get(key)
        if unwritten is not None:
            stored, copied = unwritten
            if copied is not None:
                copied.synchronize()
            return decode_row(stored, dtype, hidden)
        found = self.store.get(key, self._alloc)
        if found is None or not self._fits(found, batch, batch.spans[i]):
            return None
        return decode_row(found.tensors, dtype, hidden)

    def _fits(self, found: entries.Entry, batch: _Batch, length: int | None) -> bool:
        """An entry of the row's key is its row, unless it is of another kind, codec or shape (foreign)."""
        try:
            if found.kind != batch.stored.value or found.tokens != length or found.codec != self.codec:
                raise ValueError(f"entry of kind {found.kind}, {found.tokens} tokens, codec {found.codec}")
            assert length is not None
            check_row(found.tensors, batch.stored, length)
            return True
        except ValueError as e:
            self.store.reject(found.key, str(e))
            return False

    def _landed(self, batch: _Batch, hits: dict, missing: list[int], sent: concurrent.futures.Future) -> None:
        self._finish(batch, hits, missing, sent.result())

    def _finish(self, batch: _Batch, hits: dict[int, dict[str, torch.Tensor]], missing: list[int],
                reply: dict[str, torch.Tensor] | None) -> None:
        """Every row in place; resolve the batch (expanded for EAGLE-3); hand the new rows to the writer."""
        out = self._place(batch, hits, missing, reply)
        new_rows = self._new_rows(out, batch, missing) if self.store.writable else ([], None)
        if batch.expand is not None:
            batch.expand.later({COMPACT: out}, [COMPACT], [(0, len(batch.keys))], batch.out)
        else:
            if self.up.device.type == "cuda":
                torch.cuda.current_stream(self.up.device).synchronize()
            batch.out.set_result(out)
        rows, copied = new_rows
        for key, stored in rows:
            self._write_later(key, stored, copied, batch.stored)

    def _place(self, batch: _Batch, hits: dict[int, dict[str, torch.Tensor]], missing: list[int],
               reply: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        rows, seq = batch.input_ids.shape
        specs = reply_specs(batch.stored, batch.info, rows, seq, batch.loss_mask.dtype, None)
        device = self.up.device
        out = {name: torch.zeros(shape, dtype=dtype, device=device) for name, (dtype, shape) in specs.items()
               if name in STORED[batch.stored]}
        for i, row in hits.items():
            for name, t in row.items():
                out[name][i, : t.shape[0]].copy_(t, non_blocking=True)
        if reply is not None:
            where = torch.tensor(missing, device=device)
            for name, t in out.items():
                t.index_copy_(0, where, reply[name].to(device))
        normalize_rows(out, [n if i in missing else None for i, n in enumerate(batch.spans)])
        ids, loss = batch.input_ids.to(device, torch.int64), batch.loss_mask.to(device)
        if batch.stored is Kind.EAGLE3_COMPACT:
            ids, loss = shift_left(ids), shift_left(loss)
        out.update(input_ids=ids, loss_mask=loss)
        if device.type == "cuda":  # the pinned entries the copies read are freed once this returns
            torch.cuda.current_stream(device).synchronize()
        return {name: out[name] for name in RESPONSE_TENSORS[batch.stored]}

    def _new_rows(self, out: dict[str, torch.Tensor], batch: _Batch, missing: list[int]) -> tuple[list, Any]:
        """The missing cacheable rows in their stored form over their spans, bound for the host, and the CUDA
        event their copy completes at (None on a CPU client: already there).

        The rows are taken out of ``out`` (which the caller owns once the batch resolves) by a copy on the
        batch's stream, encoded there (fp8 quantized on the device), and copied to pinned host memory on a
        stream of their own: the batch resolves without waiting for that copy."""
        chosen = [i for i in missing if batch.keys[i] is not None]
        if not chosen:
            return [], None
        device = self.up.device
        where = torch.tensor(chosen, device=device)
        picked = {name: out[name].index_select(0, where) for name in STORED[batch.stored]}
        stored = encode_row(picked, self.codec, batch.info.hidden_size)
        copied = None
        if self._copies is not None:
            self._copies.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._copies):
                for name, t in stored.items():
                    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                    stored[name] = host.copy_(t, non_blocking=True)
                    t.record_stream(self._copies)  # its memory is not reused before the copy read it
            copied = torch.cuda.Event()
            copied.record(self._copies)
        rows = [(key, {name: t[j, : batch.spans[i]] for name, t in stored.items()})
                for j, i in enumerate(chosen) if (key := batch.keys[i]) is not None]
        return rows, copied

    def _write_later(self, key: bytes, stored: dict[str, torch.Tensor], copied: Any, kind: Kind) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in stored.values())
        with self._pending:
            self._pending.wait_for(lambda: self._pending_bytes < MAX_PENDING_WRITE_BYTES)
            if key in self._unwritten:
                return  # another batch of rows in flight at once holds it too
            self._pending_bytes += nbytes
            self._unwritten[key] = (stored, copied)
        self._writer.submit(self._write, key, stored, copied, kind, nbytes)

    def _write(self, key: bytes, stored: dict[str, torch.Tensor], copied: Any, kind: Kind, nbytes: int) -> None:
        try:
            if copied is not None:
                copied.synchronize()  # the row is on the host
            length = next(iter(stored.values())).shape[0]
            self.store.put(key, entries.encode_parts(key, kind.value, length, self.codec, stored), length)
            with self._lock:
                self.stats.stored += 1
        except Exception as e:  # a row not stored is a miss next time; training goes on
            self.store.warn_once("encode", "cache.row_not_stored", why=f"{type(e).__name__}: {e}",
                                 action="the row is fetched again when asked; further ones are not logged")
        finally:
            with self._pending:
                del self._unwritten[key]
                self._pending_bytes -= nbytes
                self._pending.notify_all()

    def _count(self, batch: _Batch, hits: dict, missing: Sequence[int]) -> None:
        with self._lock:
            s = self.stats
            s.batches += 1
            s.batches_all_hits += not missing
            s.hits += len(hits)
            s.hit_tokens += sum(batch.spans[i] or 0 for i in hits)
            for i in missing:
                if batch.keys[i] is None:
                    s.uncacheable += 1
                else:
                    s.misses += 1
                    s.miss_tokens += batch.spans[i] or 0

    def flush(self) -> None:
        """Wait for the rows handed to the writer, and publish them (other processes see them now)."""
        with self._pending:
            self._pending.wait_for(lambda: self._pending_bytes == 0)
        self.store.publish()

    def summary(self) -> dict[str, Any]:
        with self._lock:
            return {**dataclasses.asdict(self.stats), "hit_rate": self.stats.hit_rate,
                    **dataclasses.asdict(self.store.counts)}

    def close(self) -> None:
        """Finish the batches and writes under way, publish, and record this client's counts."""
        self._readers.shutdown(wait=True)
        self._rows.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        self.store.close(self.summary())


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
