"""From replies to the caller's tensors: shards merged into one batch on the client's device, and
compact EAGLE-3 batches expanded."""

from __future__ import annotations

import concurrent.futures
import functools
import math
import threading
from collections.abc import Callable, Mapping

import torch

from spec_serve.client.errors import RemoteError
from spec_serve.client.received import Received, ReceivedTensor
from spec_serve.paths.base import release, settle
from spec_serve.supervision.eagle3 import expand_compact

# check(k, reply, landed) -> None (accept shard k), a future of its retry, or raises (fail the batch).
ShardCheck = Callable[[int, Received, Mapping[str, torch.Tensor]], "concurrent.futures.Future | None"]


def shard_bounds(rows: int, num_shards: int) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` row ranges a batch of ``rows`` rows is sent as: ``num_shards`` near-equal parts."""
    return [(int(c[0]), int(c[-1]) + 1) for c in torch.arange(rows).tensor_split(min(num_shards, rows))]


def assemble(shards: list[concurrent.futures.Future], rows: list[int], device: torch.device,
             alloc: Callable[[int], torch.Tensor] | None, check: ShardCheck | None = None,
             ) -> concurrent.futures.Future:
    """One future for a batch sent as ``len(shards)`` row ranges of ``rows`` rows each (futures of ``Received``).

    As each shard's reply arrives (on the I/O thread, while ZeroMQ keeps receiving the others) its
    bytes are copied into its rows of tensors allocated once, on ``device``: no per-shard host
    tensors and no concatenation. A shard whose tensors do not fit the others' fails the batch.
    ``check(k, reply, landed)`` then sees shard ``k``'s tensors as landed: None accepts them, a future
    (a retry) is waited for instead and lands on the same rows, an exception fails the batch.
    A shard lent through the same-host plane is settled first, once copied: its slot goes back to the
    worker, and if the worker reused the slot meanwhile the shard is asked for again (frames), likewise.
    """
    batch = _Batch(rows, device, alloc, check)
    for k, future in enumerate(shards):
        future.add_done_callback(functools.partial(batch.arrived, k))
    return batch.out


class _Batch:
    """The rows of one batch, filled shard by shard as their replies arrive (on any thread)."""

    def __init__(self, rows: list[int], device: torch.device, alloc: Callable[[int], torch.Tensor] | None,
                 check: ShardCheck | None):
        self.out: concurrent.futures.Future = concurrent.futures.Future()
        self.rows = rows
        self.starts = [sum(rows[:k]) for k in range(len(rows))]
        self.device, self.alloc, self.check = device, alloc, check
        self.lock = threading.Lock()
        self.tensors: dict[str, torch.Tensor] | None = None  # the whole batch; None until the first shard
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
        landed = self._land(k, reply.tensors)
        retry = settle(reply.tensors)  # a lent reply's memory back; a retry if it was reused meanwhile
        if retry is None and self.check is not None:
            retry = self.check(k, reply, landed)
        if retry is None:
            self.left -= 1
            if not self.left:
                self.out.set_result(landed if len(self.rows) == 1 else self.tensors)
        return retry

    def _land(self, k: int, tensors: Mapping[str, ReceivedTensor]) -> dict[str, torch.Tensor]:
        if len(self.rows) == 1:
            return materialize(tensors, self.device, self.alloc)
        if self.tensors is None:
            self.tensors = _allocate_rows(tensors, sum(self.rows), self.device, self.alloc)
        lo, n = self.starts[k], self.rows[k]
        _copy_rows(tensors, self.tensors, lo, n)
        return {name: t[lo : lo + n] for name, t in self.tensors.items()}


def _release_unsettled(future: concurrent.futures.Future) -> None:
    if future.done() and not future.cancelled() and future.exception() is None:
        release(future.result().tensors)


def materialize(tensors: Mapping[str, ReceivedTensor], device: torch.device,
                alloc: Callable[[int], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """A reply's tensors on ``device``: a frame's bytes go straight there (no host staging copy); a
    single-frame CPU tensor stays a zero-copy view of its frame."""
    out = {}
    for name, part in tensors.items():
        if isinstance(part, torch.Tensor):
            out[name] = part.to(device)
            continue
        t = part.view() if device.type == "cpu" else None
        if t is None:
            t = part.copy_into(_byte_buffer(part.nbytes, device, alloc))
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


def _copy_rows(tensors: Mapping[str, ReceivedTensor], batch: dict[str, torch.Tensor], lo: int, n: int) -> None:
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
            part.copy_into(rows.view(-1).view(torch.uint8))


def expand_later(compact: concurrent.futures.Future, weight: torch.Tensor, mask: torch.Tensor,
                 device: torch.device, executor: concurrent.futures.Executor) -> concurrent.futures.Future:
    """A future of the EAGLE-3 tensors rebuilt from a compact batch on ``executor`` (off the I/O thread:
    the draft-vocab GEMM must not stall sockets), after gathering every shard, so the GEMM has the
    colocated shape."""
    out: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            expanded = expand_compact(compact.result(), weight, mask)
            if device.type == "cuda":  # resolved means complete, as for frames and NCCL replies,
                torch.cuda.current_stream(device).synchronize()  # whichever stream reads it
            out.set_result(expanded)
        except BaseException as e:
            out.set_exception(e)

    compact.add_done_callback(lambda _: executor.submit(run))
    return out
