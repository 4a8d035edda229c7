"""FP8 replies restored on the client (``wire_dtype="fp8"``): a batch whose shards came with their hidden
states in float8_e4m3fn and a float32 scale per token and captured layer (supervision/fp8.py) gets them back
in the model dtype on the client's device, off the I/O thread (the expander thread), once every shard landed
and its bytes were checked against the worker's digests (which cover the FP8 bytes and scales as sent).

A shard a worker answered in the model dtype (one that cannot send FP8) lands apart and its rows are taken
as they came. Restoring is elementwise, so a batch restored here is bit-equal to the colocated forward's
tensors put through ``fp8.quantize_reply`` and ``fp8.restore_reply`` (docs/equality.md).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Mapping

import torch

from spec_serve.supervision import fp8

# How a shard landed: (the kind its reply names, its wire_dtype; None: the model dtype).
Form = tuple[str | None, str | None]
Parts = Mapping[Form, dict[str, torch.Tensor]]


@dataclasses.dataclass
class Restoration:
    """How one batch's FP8 shards get the model ``dtype`` back, on ``device``, run on ``executor``."""

    dtype: torch.dtype
    device: torch.device
    executor: concurrent.futures.Executor

    def later(self, parts: Parts, forms: list[Form], rows: list[tuple[int, int]],
              then: Callable[[dict[str | None, dict[str, torch.Tensor]]], None],
              out: concurrent.futures.Future) -> None:
        """Restore ``parts`` (the whole batch's rows per form; shard ``k`` came as ``forms[k]`` in ``rows[k]``,
        (start, count)) and hand the batch, by kind, to ``then``; a failure fails ``out``."""

        def run() -> None:
            try:
                restored = restore_shards(parts, forms, rows, self.dtype)
                if self.device.type == "cuda":  # resolved means complete, whichever stream reads it
                    torch.cuda.current_stream(self.device).synchronize()
            except BaseException as e:
                out.set_exception(e)
                return
            then(restored)

        self.executor.submit(run)


def restore_shards(parts: Parts, forms: list[Form], rows: list[tuple[int, int]],
                   dtype: torch.dtype) -> dict[str | None, dict[str, torch.Tensor]]:
    """The batch by kind, every hidden state in ``dtype``: each FP8 form restored over the whole batch's
    rows, then the rows of shards of the same kind that came in the model dtype copied over it."""
    out = {kind: fp8.restore_reply(tensors, dtype) for (kind, wire), tensors in parts.items() if wire is not None}
    for (kind, wire), tensors in parts.items():
        if wire is not None:
            continue
        if kind not in out:
            out[kind] = tensors
            continue
        for (lo, n), form in zip(rows, forms):
            if form == (kind, None):
                for name, t in out[kind].items():
                    t[lo : lo + n].copy_(tensors[name][lo : lo + n])
    return out
