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
memory allocated; a bad message raises ``WireError`` and nothing else.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import struct
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch

from spec_serve.protocol.commands import CODEC_FRAME_BYTES

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

# The largest frame the codec makes. libzmq has failed to send a 64 MiB frame ("Bad address
# (src/tcp.cpp:227)") where 16 MiB frames worked (BENCHMARKS.md).
MAX_FRAME_BYTES = CODEC_FRAME_BYTES  # 16 MiB; receivers bound a reply's frames by it (commands.py)
# The limit safetensors itself puts on the JSON header.
MAX_HEADER_BYTES = 100_000_000
# Far above any real tensor; bounds the work a hostile header can cause.
MAX_NDIM = 64
_METADATA_KEY = "__metadata__"
_ENTRY_KEYS = frozenset(("dtype", "shape", "data_offsets"))
_INT64_LIMIT = 1 << 63

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
# One validated header entry: (name, dtype, shape, begin, end) of the data section.
_EntrySpec = tuple[str, torch.dtype, list[int], int, int]

Frame = bytes | memoryview
Alloc = Callable[[int], torch.Tensor]


class WireError(ValueError):
    """A message that cannot be encoded or is not a valid encoded message."""


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
            # view(uint8) rejects: flatten by strides. bool and bfloat16 have no
            # numpy dtype, so numpy sees the bytes as uint8.
            flat = t.as_strided((t.numel(),), (1,)).view(torch.uint8)
            view = flat.numpy().data
            frames.extend(view[i : i + MAX_FRAME_BYTES] for i in range(0, end - begin, MAX_FRAME_BYTES))
    return frames


def layout(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, list[tuple[str, torch.Tensor, int, int]]]:
    """The header frame for ``tensors`` (on any device) and where each one's bytes lie in the data section:
    ``(name, contiguous tensor, begin, end)`` in data order. What ``encode`` sends, for a data section
    that travels another way (the same-host plane)."""
    if metadata is not None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise WireError("metadata keys and values must all be str")
    prepared = []
    for name, t in tensors.items():
        if not isinstance(name, str) or name == _METADATA_KEY:
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
        header[_METADATA_KEY] = dict(metadata)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob, placed


def parse_header(
    frame: Any, data_len: int
) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...], int, int]], dict[str, str]]:
    """Check one header frame (u64 length + JSON) for a data section of ``data_len`` bytes kept elsewhere:
    ``({name: (dtype, shape, begin, end)}, metadata)``, offsets relative to the data section."""
    try:
        view = memoryview(frame).cast("B")
    except (TypeError, ValueError) as e:
        raise WireError(f"header frame is not a contiguous bytes-like object: {e}") from None
    if view.nbytes < 8:
        raise WireError(f"header frame of {view.nbytes} bytes is shorter than its 8-byte length")
    (header_len,) = struct.unpack("<Q", view[:8])
    if 8 + header_len != view.nbytes:
        raise WireError(f"header frame of {view.nbytes} bytes does not hold a {header_len}-byte header exactly")
    metadata, specs = _check_header(_parse_header(bytes(view[8:])), data_len)
    return {name: (dtype, tuple(shape), begin, end) for name, dtype, shape, begin, end in specs}, metadata


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
    views = _as_views(frames)
    starts = [0] * len(views)
    total = 0
    for i, view in enumerate(views):
        starts[i] = total
        total += view.nbytes
    if max_bytes is not None and total > max_bytes:
        raise WireError(f"message of {total} bytes exceeds max_bytes={max_bytes}")

    if total < 8:
        raise WireError(f"message of {total} bytes is shorter than the 8-byte header length")
    (header_len,) = struct.unpack("<Q", _gather(views, starts, 0, 8))
    if header_len > MAX_HEADER_BYTES:
        raise WireError(f"header length {header_len} exceeds {MAX_HEADER_BYTES}")
    if 8 + header_len > total:
        raise WireError(f"header length {header_len} runs past the end of a {total}-byte message")
    header = _parse_header(_gather(views, starts, 8, header_len))
    data_start = 8 + header_len
    metadata, specs = _check_header(header, total - data_start)

    spans = {}
    for name, dtype, shape, begin, end in specs:
        parts = _slices(views, starts, data_start + begin, end - begin)
        if dtype == torch.bool and any(np.frombuffer(p, dtype=np.uint8).max() > 1 for p in parts):
            raise WireError(f"bool tensor {name!r} holds bytes other than 0 and 1")
        spans[name] = TensorSpan(dtype, tuple(shape), parts)
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


def _as_views(frames: Iterable[Any]) -> list[memoryview]:
    try:
        frames = list(frames)
    except TypeError as e:
        raise WireError(f"frames must be an iterable of bytes-like objects: {e}") from None
    if not frames:
        raise WireError("message has no frames")
    views = []
    for i, frame in enumerate(frames):
        try:
            views.append(memoryview(frame).cast("B"))
        except (TypeError, ValueError) as e:
            raise WireError(f"frame {i} is not a contiguous bytes-like object: {e}") from None
    return views


def _gather(views: list[memoryview], starts: list[int], pos: int, n: int) -> bytes:
    """Copy ``n`` bytes from ``pos`` of the concatenated frames (header only)."""
    parts = []
    i = bisect.bisect_right(starts, pos) - 1
    while n:
        view = views[i]
        lo = pos - starts[i]
        part = view[lo : lo + n]
        parts.append(part)
        n -= part.nbytes
        pos += part.nbytes
        i += 1
    return b"".join(parts)


def _parse_header(raw: bytes) -> Any:
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)
        if len(out) != len(pairs):
            seen: set[str] = set()
            for key, _ in pairs:
                if key in seen:
                    raise WireError(f"duplicate key {key!r} in header")
                seen.add(key)
        return out

    try:
        return json.loads(raw, object_pairs_hook=no_duplicates)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
        if isinstance(e, WireError):
            raise
        raise WireError(f"header is not valid JSON: {e}") from None


def _is_int(x: Any) -> bool:
    return type(x) is int  # bool is an int subclass and not a valid size


def _check_header(header: Any, data_len: int) -> tuple[dict[str, str], list[_EntrySpec]]:
    """Validate the parsed header; return metadata and (name, dtype, shape, begin, end)."""
    if not isinstance(header, dict):
        raise WireError(f"header must be a JSON object, not {type(header).__name__}")
    metadata = header.get(_METADATA_KEY, {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise WireError("__metadata__ must be an object of string values")

    specs = [_check_entry(name, entry) for name, entry in header.items() if name != _METADATA_KEY]
    _check_tiling(specs, data_len)
    return metadata, specs


def _check_entry(name: str, entry: Any) -> _EntrySpec:
    """Validate one tensor's entry; return (name, dtype, shape, begin, end)."""
    if not isinstance(entry, dict) or entry.keys() != _ENTRY_KEYS:
        raise WireError(f"tensor {name!r}: entry must have exactly the keys {sorted(_ENTRY_KEYS)}")
    dtype = _DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if dtype is None:
        raise WireError(f"tensor {name!r}: unknown dtype {entry['dtype']!r}")
    shape, offsets = entry["shape"], entry["data_offsets"]
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_NDIM
        or not all(_is_int(d) and d >= 0 for d in shape)
    ):
        raise WireError(f"tensor {name!r}: shape {shape!r} is not a list of <= {MAX_NDIM} non-negative ints")
    # Strides are products of dims (zero dims count as 1) and must fit int64.
    if math.prod(max(d, 1) for d in shape) >= _INT64_LIMIT:
        raise WireError(f"tensor {name!r}: shape {shape} overflows int64")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(_is_int(o) for o in offsets)
        and 0 <= offsets[0] <= offsets[1]
    ):
        raise WireError(f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end")
    begin, end = offsets
    nbytes = math.prod(shape) * dtype.itemsize
    if end - begin != nbytes:
        raise WireError(
            f"tensor {name!r}: {entry['dtype']}{shape} needs {nbytes} bytes, data_offsets span {end - begin}"
        )
    return (name, dtype, shape, begin, end)


def _check_tiling(specs: list[_EntrySpec], data_len: int) -> None:
    """The data section must be tiled exactly: no gap, overlap or trailing byte."""
    pos = 0
    for name, _, _, begin, end in sorted(specs, key=lambda s: (s[3], s[4])):
        if begin != pos:
            what = "gap" if begin > pos else "overlap"
            raise WireError(f"tensor {name!r}: data_offsets start at {begin}, expected {pos} ({what})")
        pos = end
    if pos != data_len:
        raise WireError(f"tensors cover {pos} bytes but the data section holds {data_len}")


def _slices(views: list[memoryview], starts: list[int], pos: int, nbytes: int) -> tuple[memoryview, ...]:
    """The frame slices covering ``nbytes`` from ``pos`` of the concatenated frames (empty: none)."""
    parts = []
    i = bisect.bisect_right(starts, pos) - 1
    lo = pos - starts[i]
    while nbytes:
        part = views[i][lo : lo + nbytes]
        if part.nbytes:
            parts.append(part)
            nbytes -= part.nbytes
        i, lo = i + 1, 0
    return tuple(parts)
