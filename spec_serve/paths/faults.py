"""Test-only fault injection into reply paths, switched on by environment variables and off (zero) otherwise.

- ``SPEC_SERVE_TEST_FAIL_NCCL_SEND=N``: abort the pair group instead of the next N NCCL sends
  (tests/test_nccl_binding.py).
- ``SPEC_SERVE_TEST_CORRUPT_REPLIES=N``: flip one bit of the next N generate replies after their digests
  were taken, as a reused buffer or a bad link would (tests/test_integrity.py), whichever path carries them.
"""

from __future__ import annotations

import os
from typing import Any

import torch


def _count(name: str) -> int:
    return int(os.environ.get(name, "0") or 0)


class Faults:
    """The faults still to inject. Used on the compute thread only."""

    def __init__(self) -> None:
        self.fail_nccl_sends = _count("SPEC_SERVE_TEST_FAIL_NCCL_SEND")
        self.corrupt_replies = _count("SPEC_SERVE_TEST_CORRUPT_REPLIES")

    def fail_nccl_send(self) -> bool:
        """True (and one fewer to go) if this NCCL send must abort its pair group instead."""
        if self.fail_nccl_sends <= 0:
            return False
        self.fail_nccl_sends -= 1
        return True

    def _take_corruption(self) -> bool:
        if self.corrupt_replies <= 0:
            return False
        self.corrupt_replies -= 1
        return True

    def corrupt_frames(self, frames: list[Any], ready: torch.cuda.Event | None) -> None:
        """Flip the low bit of a generate reply's first data byte (``frames[0]`` is the safetensors header)."""
        if not self._take_corruption():
            return
        if ready is not None:
            ready.synchronize()  # the device->host copy must not overwrite the flip
        data = next(memoryview(f) for f in frames[1:] if len(memoryview(f)))
        data[0] ^= 1

    def corrupt_lent(self, data: torch.Tensor, ready: torch.cuda.Event | None) -> None:
        """Flip the low bit of a lent reply's first byte (``data``: its bytes where they are lent)."""
        if not self._take_corruption():
            return
        if ready is not None:
            ready.synchronize()  # the copy into the slot must not overwrite the flip
        data[0] ^= 1

    def corrupt_tensors(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The reply with one bit of its largest tensor flipped (``tensors`` itself left intact)."""
        if not self._take_corruption():
            return tensors
        name = max(tensors, key=lambda n: tensors[n].numel())
        bad = tensors[name].contiguous().clone()
        bad.view(-1).view(torch.uint8)[0] ^= 1
        return {**tensors, name: bad}
