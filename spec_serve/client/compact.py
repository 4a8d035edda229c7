"""Compact EAGLE-3 on the client: the format a worker may answer an EAGLE-3 request in (``compact=True``
always; ``compact="auto"`` whenever the reply leaves the worker's host, docs/reply-paths.md), expanded here
into exactly the EAGLE-3 tensors.

The cost, on the client: the draft-vocab rows of the target's lm_head (``[Vd, H]``: 250 MiB at Vd 32000,
H 4096, bf16), fetched from a worker once per vocab mapping and kept on the client's device (the current
mapping's and the one before it); and per compact token one ``[H] x [H, Vd]`` matmul plus a float32 softmax
over Vd, on the client's device, off the I/O thread (one expander thread). A batch is expanded once all
its shards landed, so the matmul has the colocated forward's shape.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
from collections.abc import Callable, Mapping

import torch

from spec_serve.supervision.contract import Kind
from spec_serve.supervision.eagle3 import expand_compact

FULL, COMPACT = Kind.EAGLE3.value, Kind.EAGLE3_COMPACT.value
# lm_head slices a client keeps: the current mapping's, and the previous one's for batches still in flight.
KEPT_SLICES = 2


class SliceCache:
    """The lm_head slice of each vocab mapping, fetched once (``fetch(digest, draft_vocab)``) and kept on
    the client's device for the last ``KEPT_SLICES`` mappings; any thread."""

    def __init__(self, fetch: Callable[[str, int], torch.Tensor], fetched: Callable[[torch.Tensor], None]):
        self._fetch, self._fetched = fetch, fetched
        self._slices: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()
        self._lock = threading.Lock()  # one fetch per mapping, however many batches want it at once

    def get(self, digest: str, draft_vocab: int) -> torch.Tensor:
        with self._lock:
            weight = self._slices.get(digest)
            if weight is None:
                weight = self._slices[digest] = self._fetch(digest, draft_vocab)
                self._fetched(weight)
                while len(self._slices) > KEPT_SLICES:
                    self._slices.popitem(last=False)
            self._slices.move_to_end(digest)
            return weight


@dataclasses.dataclass
class Expansion:
    """How one batch's compact shards become EAGLE-3 tensors: its mapping's lm_head slice (``weight()``,
    fetched on first use) and selected-token mask, on ``device``, run on ``executor``."""

    weight: Callable[[], torch.Tensor]
    mask: torch.Tensor
    device: torch.device
    executor: concurrent.futures.Executor

    def later(self, parts: Mapping[str | None, dict[str, torch.Tensor]], kinds: list[str | None],
              rows: list[tuple[int, int]], out: concurrent.futures.Future) -> None:
        """Resolve ``out`` with the batch as EAGLE-3 tensors (``parts``: the whole batch's rows per reply kind;
        ``kinds``: the kind shard ``k`` came in; ``rows``: its (start, count))."""

        def run() -> None:
            try:
                expanded = expand_shards(parts, kinds, rows, self.weight(), self.mask)
                if self.device.type == "cuda":  # resolved means complete, as for every other reply,
                    torch.cuda.current_stream(self.device).synchronize()  # whichever stream reads it
                out.set_result(expanded)
            except BaseException as e:
                out.set_exception(e)

        self.executor.submit(run)


def expand_shards(parts: Mapping[str | None, dict[str, torch.Tensor]], kinds: list[str | None],
                  rows: list[tuple[int, int]], weight: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The EAGLE-3 tensors of a batch whose shards came compact, or some compact and some full.

    The compact rows are expanded over the whole batch's shape (``expand_compact``: what the colocated
    forward's compact batch gives); rows of shards that came full are zeroed there first and then taken
    from the full reply, bit for bit."""
    compact = parts[COMPACT]
    full = parts.get(FULL)
    came_full = [(lo, n) for (lo, n), kind in zip(rows, kinds) if kind != COMPACT]
    if full is None or not came_full:
        return expand_compact(compact, weight, mask)
    for lo, n in came_full:
        for t in compact.values():
            t[lo : lo + n].zero_()
    expanded = expand_compact(compact, weight, mask)
    for lo, n in came_full:
        for name, t in expanded.items():
            t[lo : lo + n].copy_(full[name][lo : lo + n])
    return expanded


def expander_thread(device: torch.device) -> concurrent.futures.ThreadPoolExecutor:
    """The one thread compact batches are expanded on. It makes ``device`` current, as the caller's
    thread would (else cuBLAS warns of no context)."""
    if device.type == "cuda":
        return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="spec-serve-expand",
                                                     initializer=torch.cuda.set_device, initargs=(device,))
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="spec-serve-expand")
