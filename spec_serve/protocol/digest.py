"""End-to-end integrity of replies: a digest of every reply tensor, taken where it was computed and
checked where it landed (docs/failure-semantics.md, "Integrity").

The worker digests each tensor of a reply on its own device, from the engine's output tensors,
before any device->host copy, pooled slab or socket touches them; the client recomputes the digest
after the bytes have landed on its device (frames copied into its tensors, or whatever its reply path
received) and compares. Whatever lies in between (slabs, frames, sockets, receive buffers, a path's own
channel, row assembly) is covered.

The digest of a tensor: its bytes read as little-endian 32-bit words (a tail shorter than a word
padded with zero bytes), summed with wrap-around modulo 2**32. On a GPU that is one reduction
kernel per tensor; every digest of a reply comes back to the host in one transfer. Integer
addition modulo 2**32 does not depend on the order of the terms, so CPU and GPU, and any split of
the work, agree exactly.

What it catches: any change confined to one word (a flipped bit, a torn or zeroed word), bytes of
another message or a reused buffer in place of the right ones (a random replacement goes unnoticed
with probability 2**-32), a truncated or zero-filled tail.
What it cannot catch: words in the wrong order within a tensor (a permutation, e.g. two rows
swapped inside one shard), changes that cancel (one word +d, another -d, modulo 2**32), and shape
or dtype metadata (checked separately by ``wire.parse`` and the reply path's own checks). It is a check against
accidents, not an authenticator: anyone who can write the bytes can fix the sum (CURVE covers
tampering on the wire).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

# RemoteTargetModel(verify=...) and its environment default.
VERIFY_MODES = ("all", "sampled", "off")
VERIFY_ENV = "SPEC_SERVE_VERIFY"
# verify="sampled" checks the 1st, (1+N)th, (1+2N)th, ... request a client sends.
SAMPLE_EVERY = 8
_WORD_MASK = 0xFFFFFFFF


def tensor_digest(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim int32 tensor on ``t``'s device: the wrapping sum of ``t``'s bytes as 32-bit words
    (queued, not synchronized; read it with :func:`digests`)."""
    data = t.detach().reshape(-1)
    if not data.is_contiguous():
        data = data.contiguous()
    data = data.view(torch.uint8)
    n = data.numel()
    if n % 4 or data.data_ptr() % 4:  # bool/int8 tails or rows: copy into a padded, aligned buffer
        padded = torch.zeros((n + 3) // 4 * 4, dtype=torch.uint8, device=data.device)
        padded[:n] = data
        data = padded
    return data.view(torch.int32).sum(dtype=torch.int32)


def digests(parts: Sequence[Mapping[str, torch.Tensor]]) -> list[dict[str, int]]:
    """``[{name: digest}]`` for each mapping of tensors, as unsigned ints: every reduction is queued
    first, then read back with one host transfer per device."""
    names = [(i, name) for i, part in enumerate(parts) for name in part]
    sums = [tensor_digest(parts[i][name]) for i, name in names]
    values: list[int] = [0] * len(sums)
    by_device: dict[torch.device, list[int]] = {}
    for j, s in enumerate(sums):
        by_device.setdefault(s.device, []).append(j)
    for idx in by_device.values():
        for j, v in zip(idx, torch.stack([sums[j] for j in idx]).tolist()):
            values[j] = v & _WORD_MASK
    out: list[dict[str, int]] = [{} for _ in parts]
    for (i, name), v in zip(names, values):
        out[i][name] = v
    return out


def mismatches(expected: Any, landed: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the ``landed`` tensors whose digest differs from ``expected`` (a reply header's
    ``digests``), plus names only one side has; every name when the header carries no digests."""
    if not isinstance(expected, dict):
        return sorted(landed)
    got = digests([landed])[0]
    return sorted(n for n in set(got) | set(expected) if got.get(n) != expected.get(n))


def parse_verify(value: str | None) -> str:
    """The verify mode: ``value``, else ``$SPEC_SERVE_VERIFY``, else "all"; ``ValueError`` if unknown."""
    if value is None:
        value = os.environ.get(VERIFY_ENV) or "all"
    if value not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {value!r} "
                         f"(RemoteTargetModel(verify=...) or {VERIFY_ENV})")
    return value


class Sampler:
    """Which requests a client asks to be checked: all, none, or every ``SAMPLE_EVERY``-th (deterministic:
    the 1st, 9th, 17th, ... request this client sends, counted over all its threads)."""

    def __init__(self, mode: str):
        self.mode = parse_verify(mode)
        self._count = itertools.count()

    def wants(self) -> bool:
        if self.mode == "sampled":
            return next(self._count) % SAMPLE_EVERY == 0  # next() on a count is atomic under the GIL
        return self.mode == "all"
