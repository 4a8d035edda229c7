"""Wire codec: tensors as safetensors-compatible ZeroMQ frames, without pickle.

Frame layout of one encoded message::

    frame 0     u64 little-endian N, then N bytes of JSON header (space-padded so
                N % 8 == 0, as safetensors does)
    frame 1..   raw tensor bytes in data-offset order, each frame a zero-copy
                memoryview of the tensor's storage; a tensor over MAX_FRAME_BYTES
                spans several frames, an empty tensor has none

The header is ``{name: {"dtype": "BF16", "shape": [..], "data_offsets": [begin,
end]}, "__metadata__": {str: str}}`` with offsets relative to the data section,
so ``b"".join(frames)`` is a valid safetensors file. ``decode`` accepts any split
of such a file (including one written by ``safetensors.torch.save``): a tensor
whose bytes lie inside one frame is returned as a view of that frame, a tensor
spanning frames is assembled with exactly one copy. ``parse`` stops short of
building tensors and says where each one's bytes lie (``TensorSpan``), so a
receiver can copy them straight to their final place (a GPU, a slice of a
larger batch) with no host copy in between.

Every length, offset, dtype and shape is checked before any tensor is built or
memory allocated; a bad message raises ``WireError`` and nothing else. Those checks
are ``wire_format.py``'s, which needs no torch (the broker uses it alone).
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch

from spec_serve.protocol.wire_format import (
    MAX_FRAME_BYTES,
    MAX_HEADER_BYTES,
    MAX_NDIM,
    METADATA_KEY,
    WireError,
    parse_raw,
    read_header_frame,
)

__all__ = [
    "MAX_FRAME_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_NDIM",
    "TensorSpan",
    "WireError",
    "decode",
    "decode_with_metadata",
    "encode",
    "layout",
    "parse",
    "parse_header",
]

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}

Frame = bytes | memoryview
Alloc = Callable[[int], torch.Tensor]


def encode(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> list[Frame]:
    """Encode CPU tensors as frames: a header frame, then zero-copy data frames.

    The frames borrow the tensors' memory (a non-contiguous tensor is made
    contiguous once); do not modify the tensors until the frames are sent.
    """
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            raise WireError(f"{name!r} is on {t.device}; move it to the CPU before encoding")
    header, placed = layout(tensors, metadata)
    frames: list[Frame] = [header]
    for _, t, begin, end in placed:
        if end > begin:
            # A contiguous tensor may carry any stride on a size-1 dim, which
            # view(uint8) rejects: flatten by strides. bool, bfloat16 and float8 have
            # no numpy dtype, so numpy sees the bytes as uint8.
            flat = t.as_strided((t.numel(),), (1,)).view(torch.uint8)
            view = flat.numpy().data
            frames.extend(view[i : i + MAX_FRAME_BYTES] for i in range(0, end - begin, MAX_FRAME_BYTES))
    return frames


def layout(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, list[tuple[str, torch.Tensor, int, int]]]:
    """The header frame for ``tensors`` (on any device) and where each one's bytes lie in the data section:
    ``(name, contiguous tensor, begin, end)`` in data order. What ``encode`` sends, for a data section
    that travels another way (a reply path that lends memory)."""
    if metadata is not None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise WireError("metadata keys and values must all be str")
    prepared = []
    for name, t in tensors.items():
        if not isinstance(name, str) or name == METADATA_KEY:
            raise WireError(f"invalid tensor name {name!r}")
        if not isinstance(t, torch.Tensor):
            raise WireError(f"{name!r} is a {type(t).__name__}, not a torch.Tensor")
        if t.layout != torch.strided:
            raise WireError(f"{name!r} has layout {t.layout}; only dense tensors are supported")
        if t.dtype not in _DTYPE_NAMES:
            raise WireError(f"{name!r} has unsupported dtype {t.dtype}")
        prepared.append((name, t.detach().contiguous()))

    # Largest itemsize first (stable), as safetensors orders its data: every
    # offset is then a multiple of its tensor's itemsize, so a receiver that
    # lands the message in one buffer can view every tensor in place.
    data_order = sorted(prepared, key=lambda item: -item[1].element_size())
    entries: dict[str, dict[str, Any]] = {}
    placed = []
    offset = 0
    for name, t in data_order:
        nbytes = t.numel() * t.element_size()
        entries[name] = {
            "dtype": _DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        placed.append((name, t, offset, offset + nbytes))
        offset += nbytes

    header: dict[str, Any] = {name: entries[name] for name, _ in prepared}
    if metadata:
        header[METADATA_KEY] = dict(metadata)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob, placed


def parse_header(
    frame: Any, data_len: int
) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...], int, int]], dict[str, str]]:
    """Check one header frame (u64 length + JSON) for a data section of ``data_len`` bytes kept elsewhere:
    ``({name: (dtype, shape, begin, end)}, metadata)``, offsets relative to the data section."""
    metadata, specs = read_header_frame(frame, data_len)
    return {name: (_DTYPES[dtype], tuple(shape), begin, end) for name, dtype, shape, begin, end in specs}, metadata


@dataclasses.dataclass(frozen=True)
class TensorSpan:
    """One tensor of a parsed message: dtype, shape and the frame slices holding its bytes, in order.

    The slices borrow the received frames (they stay alive as long as the span does).
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    parts: tuple[memoryview, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def view(self) -> torch.Tensor | None:
        """The tensor as a zero-copy, read-only view of its frame; None if it spans frames or is misaligned."""
        if len(self.parts) > 1:
            return None
        if not self.parts:
            return torch.empty(self.shape, dtype=self.dtype)
        with warnings.catch_warnings():
            # Received frames are read-only; the view shares their memory.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            t = torch.frombuffer(self.parts[0], dtype=self.dtype, count=self.nbytes // self.dtype.itemsize)
        return t.view(self.shape) if t.data_ptr() % self.dtype.itemsize == 0 else None

    def copy_into(self, out: torch.Tensor) -> torch.Tensor:
        """Copy the bytes into ``out`` (a contiguous uint8 tensor of ``nbytes``, on any device); return it
        viewed as this tensor.

        CPU copies run on this thread with the GIL released and without torch's intra-op threads: those
        would compete with ZeroMQ's I/O thread, which is receiving the next message meanwhile
        (BENCHMARKS.md, "Changes"). A CUDA ``out``
        gets host-to-device copies straight from the frames, on the current stream.
        """
        if not (out.dtype == torch.uint8 and out.is_contiguous() and out.numel() == self.nbytes):
            raise ValueError(f"copy_into needs a contiguous uint8 tensor of {self.nbytes} elements")
        done = 0
        host = out.numpy() if out.device.type == "cpu" else None
        for part in self.parts:
            if host is not None:
                np.copyto(host[done : done + part.nbytes], np.frombuffer(part, dtype=np.uint8))
            else:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="The given buffer is not writable")
                    out[done : done + part.nbytes].copy_(torch.frombuffer(part, dtype=torch.uint8))
            done += part.nbytes
        return out.view(self.dtype).view(self.shape)


def parse(
    frames: Iterable[Any], *, max_bytes: int | None = None
) -> tuple[dict[str, TensorSpan], dict[str, str]]:
    """Check frames (bytes-like or ``zmq.Frame``) and say where each tensor lies: ``(spans, metadata)``.

    Every length, offset, dtype and shape is checked, and bool tensors hold only 0 and 1, before this
    returns; nothing is allocated. ``max_bytes`` bounds the total message size and is checked first.
    """
    raw, metadata = parse_raw(frames, max_bytes=max_bytes)
    spans = {name: TensorSpan(_DTYPES[span.dtype], span.shape, span.parts) for name, span in raw.items()}
    return spans, metadata


def decode(
    frames: Iterable[Any], *, max_bytes: int | None = None, alloc: Alloc | None = None
) -> dict[str, torch.Tensor]:
    """Decode frames (bytes-like or ``zmq.Frame``) into tensors; see ``decode_with_metadata``."""
    return decode_with_metadata(frames, max_bytes=max_bytes, alloc=alloc)[0]


def decode_with_metadata(
    frames: Iterable[Any], *, max_bytes: int | None = None, alloc: Alloc | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Decode frames into ``(tensors, metadata)``, in header order.

    A tensor lying inside one (suitably aligned) frame is a view of it: it
    keeps the frame alive and must be treated as read-only. Other tensors are
    copied once into ``alloc(nbytes)`` (a contiguous CPU uint8 tensor of exactly
    ``nbytes`` elements, e.g. from a buffer pool) or a fresh tensor.
    ``max_bytes`` bounds the total message size and is checked first.
    """
    spans, metadata = parse(frames, max_bytes=max_bytes)
    tensors = {}
    for name, span in spans.items():
        t = span.view()
        if t is None:
            n = span.nbytes
            out = torch.empty(n, dtype=torch.uint8) if alloc is None else alloc(n)
            if not (out.dtype == torch.uint8 and out.device.type == "cpu" and out.is_contiguous() and out.numel() == n):
                raise ValueError(f"alloc({n}) must return a contiguous CPU uint8 tensor of {n} elements")
            t = span.copy_into(out)
        tensors[name] = t
    return tensors, metadata
