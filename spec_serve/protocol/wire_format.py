"""The wire codec's format without torch: frame limits, the safetensors header's checks, and where each
tensor's bytes lie in the frames (``RawSpan``, its dtype as the header spells it).

``wire.py`` builds torch tensors on top of this. The broker reads the one payload it must understand (a
draft-vocab mapping) with it alone, so the broker process never imports torch.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import struct
from collections.abc import Iterable
from typing import Any

import numpy as np

from spec_serve.protocol.commands import CODEC_FRAME_BYTES

# The largest frame the codec makes (1 MiB: commands.py says why). libzmq has also failed to send a 64 MiB frame
# ("Bad address (src/tcp.cpp:227)") where 16 MiB frames worked (BENCHMARKS.md).
MAX_FRAME_BYTES = CODEC_FRAME_BYTES  # receivers bound a reply's frames by it (commands.py)
# The limit safetensors itself puts on the JSON header.
MAX_HEADER_BYTES = 100_000_000
# Far above any real tensor; bounds the work a hostile header can cause.
MAX_NDIM = 64
METADATA_KEY = "__metadata__"
_ENTRY_KEYS = frozenset(("dtype", "shape", "data_offsets"))
_INT64_LIMIT = 1 << 63

# safetensors dtype name -> bytes per element; the codec's dtypes, exactly. F8_E4M3 (torch.float8_e4m3fn,
# safetensors' name for it) carries hidden states of wire_dtype="fp8" replies.
ITEMSIZE: dict[str, int] = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "I64": 8, "I32": 4, "I16": 2,
                            "I8": 1, "U8": 1, "BOOL": 1}
# The same as numpy dtypes (little-endian, as safetensors stores them); bfloat16 and float8 have none.
_NUMPY_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
                 "U8": "u1", "BOOL": "?"}

# One validated header entry: (name, dtype name, shape, begin, end) of the data section.
EntrySpec = tuple[str, str, list[int], int, int]


class WireError(ValueError):
    """A message that cannot be encoded or is not a valid encoded message."""


@dataclasses.dataclass(frozen=True)
class RawSpan:
    """One tensor of a parsed message: dtype name, shape and the frame slices holding its bytes, in order.

    The slices borrow the received frames (they stay alive as long as the span does).
    """

    dtype: str
    shape: tuple[int, ...]
    parts: tuple[memoryview, ...]

    def array(self) -> np.ndarray:
        """The tensor as a numpy array (a copy when it spans frames); WireError for bfloat16 and float8, which
        numpy lacks."""
        if self.dtype not in _NUMPY_DTYPES:
            raise WireError(f"a {self.dtype} tensor has no numpy dtype")
        data = self.parts[0] if len(self.parts) == 1 else b"".join(self.parts)
        return np.frombuffer(data, dtype=_NUMPY_DTYPES[self.dtype]).reshape(self.shape)


def read_header_frame(frame: Any, data_len: int) -> tuple[dict[str, str], list[EntrySpec]]:
    """Check one header frame (u64 length + JSON) for a data section of ``data_len`` bytes kept elsewhere:
    ``(metadata, entries)``, offsets relative to the data section."""
    try:
        view = memoryview(frame).cast("B")
    except (TypeError, ValueError) as e:
        raise WireError(f"header frame is not a contiguous bytes-like object: {e}") from None
    if view.nbytes < 8:
        raise WireError(f"header frame of {view.nbytes} bytes is shorter than its 8-byte length")
    (header_len,) = struct.unpack("<Q", view[:8])
    if 8 + header_len != view.nbytes:
        raise WireError(f"header frame of {view.nbytes} bytes does not hold a {header_len}-byte header exactly")
    return check_header(parse_json(bytes(view[8:])), data_len)


def parse_raw(frames: Iterable[Any], *, max_bytes: int | None = None) -> tuple[dict[str, RawSpan], dict[str, str]]:
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
    header = parse_json(_gather(views, starts, 8, header_len))
    data_start = 8 + header_len
    metadata, specs = check_header(header, total - data_start)

    spans = {}
    for name, dtype, shape, begin, end in specs:
        parts = _slices(views, starts, data_start + begin, end - begin)
        if dtype == "BOOL" and any(np.frombuffer(p, dtype=np.uint8).max() > 1 for p in parts):
            raise WireError(f"bool tensor {name!r} holds bytes other than 0 and 1")
        spans[name] = RawSpan(dtype, tuple(shape), parts)
    return spans, metadata


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


def parse_json(raw: bytes) -> Any:
    """The header's JSON, refusing duplicate keys."""
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


def check_header(header: Any, data_len: int) -> tuple[dict[str, str], list[EntrySpec]]:
    """Validate the parsed header; return metadata and (name, dtype name, shape, begin, end)."""
    if not isinstance(header, dict):
        raise WireError(f"header must be a JSON object, not {type(header).__name__}")
    metadata = header.get(METADATA_KEY, {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise WireError("__metadata__ must be an object of string values")

    specs = [_check_entry(name, entry) for name, entry in header.items() if name != METADATA_KEY]
    _check_tiling(specs, data_len)
    return metadata, specs


def _check_entry(name: str, entry: Any) -> EntrySpec:
    """Validate one tensor's entry; return (name, dtype name, shape, begin, end)."""
    if not isinstance(entry, dict) or entry.keys() != _ENTRY_KEYS:
        raise WireError(f"tensor {name!r}: entry must have exactly the keys {sorted(_ENTRY_KEYS)}")
    dtype = entry["dtype"]
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise WireError(f"tensor {name!r}: unknown dtype {dtype!r}")
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
    nbytes = math.prod(shape) * ITEMSIZE[dtype]
    if end - begin != nbytes:
        raise WireError(f"tensor {name!r}: {dtype}{shape} needs {nbytes} bytes, data_offsets span {end - begin}")
    return (name, dtype, shape, begin, end)


def _check_tiling(specs: list[EntrySpec], data_len: int) -> None:
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
