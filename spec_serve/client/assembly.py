"""From replies to the caller's tensors: shards merged into one batch on the client's device, and
compact EAGLE-3 shards expanded (compact.py)."""

from __future__ import annotations

import concurrent.futures
import functools
import math
import threading
from collections.abc import Callable, Mapping

import torch

from spec_serve.client.compact import COMPACT, Expansion
from spec_serve.client.errors import RemoteError
from spec_serve.client.received import Received, ReceivedTensor
from spec_serve.client.restore import Form, Restoration
from spec_serve.client.staging import Staging, land
from spec_serve.paths.base import release, settle
from spec_serve.protocol.messages import Reply

# check(k, reply, landed) -> None (accept shard k), a future of its retry, or raises (fail the batch).
ShardCheck = Callable[[int, Received, Mapping[str, torch.Tensor]], "concurrent.futures.Future | None"]


def shard_bounds(rows: int, num_shards: int) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` row ranges a batch of ``rows`` rows is sent as: ``num_shards`` near-equal parts."""
    return [(int(c[0]), int(c[-1]) + 1) for c in torch.arange(rows).tensor_split(min(num_shards, rows))]


def assemble(shards: list[concurrent.futures.Future], rows: list[int], device: torch.device,
             alloc: Callable[[int], torch.Tensor] | None, check: ShardCheck | None = None,
             asked: str | None = None, expand: Expansion | None = None,
             staging: Staging | None = None, restore: Restoration | None = None) -> concurrent.futures.Future:
    """One future for a batch sent as ``len(shards)`` row ranges of ``rows`` rows each (futures of ``Received``).

    As each shard's reply arrives (on the I/O thread, while ZeroMQ keeps receiving the others) its
    bytes are copied into its rows of tensors allocated once, on ``device``: no per-shard host
    tensors and no concatenation. A shard whose tensors do not fit the others' fails the batch.
    ``check(k, reply, landed)`` then sees shard ``k``'s tensors as landed: None accepts them, a future
    (a retry) is waited for instead and lands on the same rows, an exception fails the batch.
    A shard whose path lent it memory is settled first, once copied: its slot goes back to the
    worker, and if the worker reused the slot meanwhile the shard is asked for again (frames), likewise.

    Shards land per the kind their reply names (``asked`` when it names none: a worker may answer
    compact="auto" requests full or compact); with ``expand``, compact EAGLE-3 shards are expanded once
    every shard landed, off the I/O thread, and the batch resolves to the EAGLE-3 tensors. With ``restore``
    (a request of wire_dtype="fp8"), shards whose reply came in FP8 get the model dtype back first
    (restore.py), likewise. With ``staging`` (a GPU ``device``), frames land through its pinned slabs
    (staging.py).
    """
    batch = _Batch(rows, device, alloc, check, asked, expand, staging, restore)
    for k, future in enumerate(shards):
        future.add_done_callback(functools.partial(batch.arrived, k))
    return batch.out


class _Batch:
    """The rows of one batch, filled shard by shard as their replies arrive (on any thread)."""

    def __init__(self, rows: list[int], device: torch.device, alloc: Callable[[int], torch.Tensor] | None,
                 check: ShardCheck | None, asked: str | None, expand: Expansion | None, staging: Staging | None,
                 restore: Restoration | None):
        self.out: concurrent.futures.Future = concurrent.futures.Future()
        self.rows = rows
        self.starts = [sum(rows[:k]) for k in range(len(rows))]
        self.device, self.alloc, self.check, self.asked, self.expand = device, alloc, check, asked, expand
        self.staging, self.restore = staging, restore
        self.lock = threading.Lock()
        # The whole batch's rows per form a reply came in (its kind, its wire dtype), each allocated on its
        # first shard.
        self.parts: dict[Form, dict[str, torch.Tensor]] = {}
        self.forms: list[Form] = [(None, None)] * len(rows)  # the form each shard landed as
        self.left = len(rows)

    def arrived(self, k: int, future: concurrent.futures.Future) -> None:
        retry = None
        with self.lock:
            try:
                if not self.out.done():
                    retry = self._accept(k, future.result())
            except BaseException as e:
                self.out.set_exception(e)
            finally:
                _release_unsettled(future)  # a lent reply not settled above (the batch failed): its slot back
        if retry is not None:
            retry.add_done_callback(lambda f: self.arrived(k, f))

    def _accept(self, k: int, reply: Received) -> concurrent.futures.Future | None:
        """Land shard ``k``; the future of its retry if its bytes cannot be used, else None."""
        header = reply.header if isinstance(reply.header, Reply) else None
        form = ((header.kind if header is not None else None) or self.asked,
                header.wire_dtype if header is not None else None)
        landed = self._land(k, reply.tensors, form)
        retry = settle(reply.tensors)  # a lent reply's memory back; a retry if it was reused meanwhile
        if retry is None and self.check is not None:
            retry = self.check(k, reply, landed)  # the bytes as sent: FP8 ones restored only after
        if retry is None:
            self.forms[k] = form
            self.left -= 1
            if not self.left:
                self._finish()
        return retry

    def _land(self, k: int, tensors: Mapping[str, ReceivedTensor], form: Form) -> dict[str, torch.Tensor]:
        if len(self.rows) == 1:
            landed = self.parts[form] = materialize(tensors, self.device, self.alloc, self.staging)
            return landed
        part = self.parts.get(form)
        if part is None:
            part = self.parts[form] = _allocate_rows(tensors, sum(self.rows), self.device, self.alloc)
        lo, n = self.starts[k], self.rows[k]
        _copy_rows(tensors, part, lo, n, self.staging)
        return {name: t[lo : lo + n] for name, t in part.items()}

    def _finish(self) -> None:
        """Every shard landed: the batch, restored (FP8 shards) and expanded (compact shards), resolves ``out``."""
        landed = {form: self.parts[form] for form in dict.fromkeys(self.forms)}  # not a form a retry replaced
        if self.restore is not None and any(wire is not None for _, wire in landed):
            self.restore.later(landed, self.forms, list(zip(self.starts, self.rows)), self._resolve, self.out)
        else:  # every shard in the model dtype: one form per kind
            self._resolve({kind: part for (kind, _), part in landed.items()})

    def _resolve(self, parts: dict[str | None, dict[str, torch.Tensor]]) -> None:
        """``out`` from the batch's rows per kind (any thread): as they are, or expanded."""
        kinds = [kind for kind, _ in self.forms]
        if self.expand is not None and COMPACT in kinds:
            self.expand.later(parts, kinds, list(zip(self.starts, self.rows)), self.out)
        elif len(set(kinds)) == 1:
            self.out.set_result(parts[kinds[0]])
        else:
            self.out.set_exception(RemoteError(f"shards came back in different kinds {sorted(map(str, set(kinds)))} "
                                               f"and nothing expands them"))


def _release_unsettled(future: concurrent.futures.Future) -> None:
    if future.done() and not future.cancelled() and future.exception() is None:
        release(future.result().tensors)


def materialize(tensors: Mapping[str, ReceivedTensor], device: torch.device,
                alloc: Callable[[int], torch.Tensor] | None = None,
                staging: Staging | None = None) -> dict[str, torch.Tensor]:
    """A reply's tensors on ``device``: a frame's bytes go there straight, or through ``staging``'s pinned
    slabs (a GPU); a single-frame CPU tensor stays a zero-copy view of its frame."""
    out = {}
    for name, part in tensors.items():
        if isinstance(part, torch.Tensor):
            out[name] = part.to(device)
            continue
        t = part.view() if device.type == "cpu" else None
        if t is None:
            t = land(part, _byte_buffer(part.nbytes, device, alloc), staging)
        out[name] = t
    return out


def _allocate_rows(tensors: Mapping[str, ReceivedTensor], total_rows: int, device: torch.device,
                   alloc: Callable[[int], torch.Tensor] | None) -> dict[str, torch.Tensor]:
    out = {}
    for name, part in tensors.items():
        if len(part.shape) == 0:
            raise RemoteError(f"sharded reply tensor {name!r} has no batch dimension")
        shape = (total_rows, *part.shape[1:])
        nbytes = math.prod(shape) * part.dtype.itemsize
        out[name] = _byte_buffer(nbytes, device, alloc).view(part.dtype).view(shape)
    return out


def _byte_buffer(nbytes: int, device: torch.device, alloc: Callable[[int], torch.Tensor] | None) -> torch.Tensor:
    """``nbytes`` uint8 on ``device`` for a reply tensor: recycled on the CPU (fresh large buffers fault
    on every page), from the caching allocator on a GPU."""
    if device.type == "cpu" and alloc is not None:
        return alloc(nbytes)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _copy_rows(tensors: Mapping[str, ReceivedTensor], batch: dict[str, torch.Tensor], lo: int, n: int,
               staging: Staging | None) -> None:
    if tensors.keys() != batch.keys():
        raise RemoteError(f"shards disagree on reply tensors: {sorted(tensors)} vs {sorted(batch)}")
    for name, part in tensors.items():
        dst = batch[name]
        if part.dtype != dst.dtype or tuple(part.shape) != (n, *dst.shape[1:]):
            raise RemoteError(f"shard tensor {name!r} is {part.dtype}{list(part.shape)}, expected "
                              f"{dst.dtype}{[n, *dst.shape[1:]]}")
        rows = dst[lo : lo + n]
        if isinstance(part, torch.Tensor):
            rows.copy_(part)
        else:
            land(part, rows.view(-1).view(torch.uint8), staging)
