"""Test-only fault injection into reply paths, switched on by environment variables and off (zero) otherwise.

- ``SPEC_SERVE_TEST_FAIL_NCCL_SEND=N``: abort the pair group instead of the next N NCCL sends
  (tests/paths/test_nccl_binding.py).
- ``SPEC_SERVE_TEST_CORRUPT_REPLIES=N``: flip one bit of the next N generate replies after their digests
  were taken, as a reused buffer or a bad link would (tests/client/test_integrity.py). The i-th flip lands in the
  reply's (i mod n)-th tensor, at an offset spread over that tensor (``corruption_offset``), on whichever
  path carries the reply: frames, a same-host plane slot, or the NCCL pair group. Each is logged
  (``worker.test_corruption tensor= offset=``).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from typing import Any

import torch

from spec_serve.protocol import wire
from spec_serve.telemetry.logs import event

log = logging.getLogger("spec_serve.worker")
GOLDEN = (math.sqrt(5) - 1) / 2


def corruption_offset(i: int, nbytes: int) -> int:
    """The byte the i-th flip hits in a tensor of ``nbytes``: the golden-ratio sequence over [0, nbytes), so
    successive flips spread over the whole tensor (most far past its first pages), never the same place twice
    in a row."""
    return int(nbytes * ((i + 1) * GOLDEN % 1.0))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _count(name: str) -> int:
    return int(os.environ.get(name, "0") or 0)


class Faults:
    """The faults still to inject. Used on the compute thread only."""

    def __init__(self) -> None:
        self.fail_nccl_sends = _count("SPEC_SERVE_TEST_FAIL_NCCL_SEND")
        self.corrupt_replies = _count("SPEC_SERVE_TEST_CORRUPT_REPLIES")
        self.corrupted = 0  # flips made so far

    def fail_nccl_send(self) -> bool:
        """True (and one fewer to go) if this NCCL send must abort its pair group instead."""
        if self.fail_nccl_sends <= 0:
            return False
        self.fail_nccl_sends -= 1
        return True

    def _next_flip(self, tensors: Mapping[str, torch.Tensor]) -> tuple[str, int] | None:
        """(tensor name, byte offset) of the next flip, if one is due for this reply."""
        names = [name for name, t in tensors.items() if _nbytes(t)]
        if self.corrupt_replies <= 0 or not names:
            return None
        self.corrupt_replies -= 1
        i, self.corrupted = self.corrupted, self.corrupted + 1
        name = names[i % len(names)]
        offset = corruption_offset(i // len(names), _nbytes(tensors[name]))
        event(log, logging.WARNING, "worker.test_corruption", tensor=name, offset=offset,
              nbytes=_nbytes(tensors[name]), env="SPEC_SERVE_TEST_CORRUPT_REPLIES")
        return name, offset

    def corrupt_frames(self, frames: list[Any], ready: torch.cuda.Event | None,
                       tensors: Mapping[str, torch.Tensor]) -> None:
        """Flip one bit of a generate reply's frames (``tensors``: what they were encoded from)."""
        flip = self._next_flip(tensors)
        if flip is None:
            return
        if ready is not None:
            ready.synchronize()  # the device->host copy must not overwrite the flip
        name, offset = flip
        index = 1  # frames[0] is the header; each tensor's bytes follow in frames of MAX_FRAME_BYTES
        for placed, _, begin, end in wire.layout(tensors)[1]:
            if placed == name:
                memoryview(frames[index + offset // wire.MAX_FRAME_BYTES]).cast("B")[
                    offset % wire.MAX_FRAME_BYTES] ^= 1
                return
            index += -(-(end - begin) // wire.MAX_FRAME_BYTES)

    def corrupt_lent(self, data: torch.Tensor, ready: torch.cuda.Event | None,
                     tensors: Mapping[str, torch.Tensor]) -> None:
        """Flip one bit of a lent reply where it is lent (``data``: its slot's bytes; ``tensors``: what was
        copied there)."""
        flip = self._next_flip(tensors)
        if flip is None:
            return
        if ready is not None:
            ready.synchronize()  # the copy into the slot must not overwrite the flip
        name, offset = flip
        begin = next(begin for placed, _, begin, _ in wire.layout(tensors)[1] if placed == name)
        data[begin + offset] ^= 1

    def corrupt_tensors(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The NCCL reply with one bit flipped (``tensors`` itself left intact)."""
        flip = self._next_flip(tensors)
        if flip is None:
            return tensors
        name, offset = flip
        bad = tensors[name].contiguous().clone()
        bad.view(-1).view(torch.uint8)[offset] ^= 1
        return {**tensors, name: bad}
