"""Wire codec: round trips, safetensors compatibility, zero copy, hostile input."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
import zmq
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from spec_serve.protocol.wire import MAX_FRAME_BYTES, WireError, decode, decode_with_metadata, encode

DTYPES = [
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.float8_e4m3fn,  # wire_dtype="fp8" hidden states
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
DTYPE_NAMES = ["F32", "F64", "BF16", "F16", "F8_E4M3", "I64", "I32", "I16", "I8", "U8", "BOOL"]

FAST = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SOME = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a tensor, so NaNs (and -0.0) compare bit for bit."""
    # A fresh tensor has standard strides (contiguous() keeps odd ones on size-1 dims).
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1).view(torch.uint8)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype, name
        assert got[name].shape == t.shape, name
        assert torch.equal(bits(got[name]), bits(t)), name


def address(buf) -> int:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


def in_a_frame(t: torch.Tensor, frames) -> bool:
    """Whether all of ``t``'s bytes lie inside one of ``frames``."""
    ptr, n = t.data_ptr(), t.numel() * t.element_size()
    return any(address(f) <= ptr and ptr + n <= address(f) + memoryview(f).nbytes for f in frames)


def raw_message(header, data: bytes = b"", length: int | None = None) -> list[bytes]:
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    return [struct.pack("<Q", len(blob) if length is None else length) + blob, data]


def decode_or_wire_error(frames, **kwargs):
    """Decode; a WireError is fine, any other exception fails the test."""
    try:
        return decode(frames, **kwargs)
    except WireError:
        return None


@st.composite
def tensors(draw, max_dim: int = 4) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, max_dim), max_size=4))
    nbytes = math.prod(shape) * dtype.itemsize
    raw = torch.tensor(list(draw(st.binary(min_size=nbytes, max_size=nbytes))), dtype=torch.uint8)
    if dtype == torch.bool:
        raw &= 1
    t = raw.view(dtype).reshape(shape)
    layout = draw(st.sampled_from(["contiguous", "transposed", "strided"]))
    if layout == "transposed" and t.dim() >= 2:
        t = t.transpose(0, -1)
    elif layout == "strided" and t.dim() >= 1:
        t = t[::2]
    return t


names = st.text(max_size=8).filter(lambda s: s != "__metadata__")
tensor_dicts = st.dictionaries(names, tensors(), max_size=4)
metadatas = st.none() | st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3)


# --- round trips ---------------------------------------------------------------------------


@FAST
@given(tensor_dicts, metadatas)
def test_round_trip(tensors, metadata):
    frames = encode(tensors, metadata)
    assert all(memoryview(f).nbytes <= MAX_FRAME_BYTES for f in frames)

    got, meta = decode_with_metadata(frames)
    assert_same(got, tensors)
    assert meta == (metadata or {})

    # As a receiver sees them: independent read-only buffers.
    got, meta = decode_with_metadata([bytes(f) for f in frames])
    assert_same(got, tensors)
    assert meta == (metadata or {})
    for t in got.values():
        assert t.data_ptr() % t.element_size() == 0

    # The concatenation is a safetensors file.
    loaded = safetensors.torch.load(b"".join(frames))
    assert_same({k: loaded[k] for k in tensors}, tensors)


@FAST
@given(tensor_dicts, metadatas, st.lists(st.floats(0, 1), max_size=6))
def test_safetensors_file_split_anywhere(tensors, metadata, cuts):
    contiguous = {k: v.contiguous() for k, v in tensors.items()}
    blob = safetensors.torch.save(contiguous, metadata=metadata or None)
    points = sorted(int(c * len(blob)) for c in cuts)
    frames = [blob[a:b] for a, b in zip([0, *points], [*points, len(blob)])]

    got, meta = decode_with_metadata(frames)
    assert got.keys() == contiguous.keys()
    assert_same({k: got[k] for k in contiguous}, contiguous)
    assert meta == (metadata or {})
    for t in got.values():
        assert t.data_ptr() % t.element_size() == 0


def test_scalars_empties_and_no_tensors():
    tensors = {
        "scalar": torch.tensor(float("nan")),
        "flag": torch.tensor(True),
        "empty": torch.empty(0, 3, dtype=torch.bfloat16),
        "ids": torch.arange(5),
    }
    assert_same(decode(encode(tensors)), tensors)
    assert decode_with_metadata(encode({}, {"k": "v"})) == ({}, {"k": "v"})
    assert decode(encode({})) == {}


def test_large_tensor_spans_frames_and_uses_alloc():
    big = torch.randint(-128, 127, (2 * MAX_FRAME_BYTES + 12,), dtype=torch.int8)
    small = torch.randn(3, 5)
    frames = encode({"big": big, "small": small})
    sizes = [memoryview(f).nbytes for f in frames[1:]]
    assert sizes == [60, MAX_FRAME_BYTES, MAX_FRAME_BYTES, 12]
    assert max(sizes) <= MAX_FRAME_BYTES

    received = [bytes(f) for f in frames]
    pool = torch.empty(big.numel(), dtype=torch.uint8)
    asked = []

    def alloc(nbytes):
        asked.append(nbytes)
        return pool[:nbytes]

    got = decode(received, alloc=alloc)
    assert asked == [big.numel()]  # only the spanning tensor is copied
    assert got["big"].data_ptr() == pool.data_ptr()
    assert_same(got, {"big": big, "small": small})
    assert torch.equal(decode(received)["big"], big)


def test_bad_alloc_is_reported():
    frames = [bytes(f) for f in encode({"x": torch.zeros(MAX_FRAME_BYTES + 4, dtype=torch.uint8)})]
    with pytest.raises(ValueError, match="alloc"):
        decode(frames, alloc=lambda n: torch.empty(n, dtype=torch.float32))


# --- zero copy -----------------------------------------------------------------------------


def test_encode_shares_tensor_memory():
    t = torch.randn(64, 64)
    frames = encode({"t": t})
    assert address(frames[1]) == t.data_ptr()


def test_decode_does_not_copy():
    t = torch.randn(256, 64).bfloat16()
    frames = [bytes(f) for f in encode({"t": t, "m": torch.ones(7, dtype=torch.bool)})]
    got = decode(frames)
    assert in_a_frame(got["t"], frames) and in_a_frame(got["m"], frames)
    # One buffer holding the whole message, as after a receive into a pooled buffer.
    whole = bytearray(b"".join(frames))
    got = decode([whole])
    assert in_a_frame(got["t"], [whole]) and in_a_frame(got["m"], [whole])


def test_misaligned_frame_is_copied_aligned():
    t = torch.arange(10, dtype=torch.float64)
    header, data = encode({"t": t})
    shifted = memoryview(bytearray(1) + bytes(data))[1:]
    assert address(shifted) % 8
    got = decode([header, shifted])["t"]
    assert got.data_ptr() % 8 == 0 and torch.equal(got, t)


def test_over_zmq_frames():
    tensors = {"h": torch.randn(4, 128).bfloat16(), "ids": torch.arange(8), "m": torch.ones(3, dtype=torch.bool)}
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://wire-test")
        b.connect("inproc://wire-test")
        a.send_multipart(encode(tensors, {"rid": "7"}), copy=False)
        frames = b.recv_multipart(copy=False)
        got, meta = decode_with_metadata(frames)
        assert_same(got, tensors)
        assert meta == {"rid": "7"}
        assert all(in_a_frame(t, [f.buffer for f in frames]) for t in got.values())
    finally:
        a.close(linger=0)
        b.close(linger=0)


# --- encode errors -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tensors, metadata, match",
    [
        ({"x": torch.zeros(2, device="meta")}, None, "move it to the CPU"),
        ({"x": torch.zeros(2, dtype=torch.complex64)}, None, "unsupported dtype"),
        ({"x": [1, 2]}, None, "not a torch.Tensor"),
        ({"x": torch.zeros(2).to_sparse()}, None, "dense"),
        ({"__metadata__": torch.zeros(2)}, None, "invalid tensor name"),
        ({3: torch.zeros(2)}, None, "invalid tensor name"),
        ({"x": torch.zeros(2)}, {"k": 1}, "metadata"),
    ],
)
def test_encode_rejects(tensors, metadata, match):
    with pytest.raises(WireError, match=match):
        encode(tensors, metadata)


# --- hostile input -------------------------------------------------------------------------

ENTRY = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    "frames, match",
    [
        ([], "no frames"),
        ([b"\x01\x02"], "shorter than"),
        ([b"abc", 5], "not a contiguous bytes-like"),
        ("not frames", "not a contiguous bytes-like"),
        (None, "iterable"),
        (raw_message(b"{}", length=100_000_001), "exceeds"),
        (raw_message(b"{}", length=3), "runs past"),
        (raw_message(b""), "not valid JSON"),
        (raw_message(b"\xff\xfe"), "not valid JSON"),
        (raw_message(b"[" * 100_000), "not valid JSON"),
        (raw_message([ENTRY], b"\0" * 8), "JSON object"),
        (raw_message(b'{"a":' + json.dumps(ENTRY).encode() + b',"a":' + json.dumps(ENTRY).encode() + b"}"),
         "duplicate"),
        (raw_message({"a": {**ENTRY, "dtype": "F8"}}, b"\0" * 8), "unknown dtype"),
        (raw_message({"a": {**ENTRY, "dtype": ["F32"]}}, b"\0" * 8), "unknown dtype"),
        (raw_message({"a": {**ENTRY, "shape": [-2]}}, b"\0" * 8), "shape"),
        (raw_message({"a": {**ENTRY, "shape": [2.0]}}, b"\0" * 8), "shape"),
        (raw_message({"a": {**ENTRY, "shape": [True, 2]}}, b"\0" * 8), "shape"),
        (raw_message({"a": {**ENTRY, "shape": [1] * 65}}, b"\0" * 8), "shape"),
        (raw_message({"a": {**ENTRY, "shape": [0, 2**62, 4], "data_offsets": [0, 0]}}), "overflows"),
        (raw_message({"a": {**ENTRY, "shape": [2**64], "data_offsets": [0, 0]}}), "overflows"),
        (raw_message({"a": {**ENTRY, "shape": [3]}}, b"\0" * 8), "needs 12 bytes"),
        (raw_message({"a": {**ENTRY, "data_offsets": [8, 0]}}, b"\0" * 8), "data_offsets"),
        (raw_message({"a": {**ENTRY, "data_offsets": [0, "8"]}}, b"\0" * 8), "data_offsets"),
        (raw_message({"a": {**ENTRY, "data_offsets": [0, 8, 8]}}, b"\0" * 8), "data_offsets"),
        (raw_message({"a": {**ENTRY, "data_offsets": [4, 12]}}, b"\0" * 12), "gap"),
        (raw_message({"a": ENTRY, "b": {**ENTRY, "data_offsets": [4, 12]}}, b"\0" * 12), "overlap"),
        (raw_message({"a": ENTRY}, b"\0" * 9), "data section holds 9"),
        (raw_message({"a": ENTRY}, b"\0" * 7), "needs 8 bytes|holds 7"),
        (raw_message({"a": {"dtype": "F32", "shape": [2]}}, b"\0" * 8), "exactly the keys"),
        (raw_message({"a": {**ENTRY, "extra": 1}}, b"\0" * 8), "exactly the keys"),
        (raw_message({"a": 5}, b"\0" * 8), "exactly the keys"),
        (raw_message({"__metadata__": {"k": 1}}), "__metadata__"),
        (raw_message({"__metadata__": ["k"]}), "__metadata__"),
        (raw_message({"a": {**ENTRY, "dtype": "BOOL", "shape": [8]}}, b"\0\1\2\0\0\0\0\0"), "bool"),
    ],
)
def test_decode_rejects(frames, match):
    with pytest.raises(WireError, match=match):
        decode(frames)


def test_max_bytes_checked_before_allocating():
    frames = [bytes(f) for f in encode({"x": torch.zeros(MAX_FRAME_BYTES + 4, dtype=torch.uint8)})]
    total = sum(map(len, frames))

    def alloc(nbytes):
        raise AssertionError("allocated before the size check")

    with pytest.raises(WireError, match="max_bytes"):
        decode(frames, max_bytes=total - 1, alloc=alloc)
    assert decode(frames, max_bytes=total)["x"].numel() == MAX_FRAME_BYTES + 4


def test_every_truncation_rejected():
    tensors = {"a": torch.randn(3, 2), "b": torch.tensor([True, False]), "c": torch.tensor(7)}
    blob = b"".join(encode(tensors, {"k": "v"}))
    for cut in range(len(blob)):
        with pytest.raises(WireError):
            decode([blob[:cut]])
        with pytest.raises(WireError):
            decode([blob[:cut], blob[cut:], b"\0"])  # trailing byte


@SOME
@given(st.lists(st.binary(max_size=64), max_size=4))
def test_random_bytes_never_crash(frames):
    decode_or_wire_error(frames)


json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=4)
json_values = st.recursive(
    json_scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c, max_size=3), max_leaves=8
)
entries = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(DTYPE_NAMES) | json_values,
        "shape": st.lists(st.integers(-2, 5), max_size=3) | json_values,
        "data_offsets": st.lists(st.integers(-2, 40), min_size=2, max_size=2) | json_values,
    }
)


@FAST
@given(
    st.dictionaries(names, entries | json_values, max_size=3),
    st.binary(max_size=48),
    st.integers(-3, 3),
)
def test_schema_shaped_garbage_never_crashes(header, data, length_error):
    blob = json.dumps(header).encode()
    length = max(0, len(blob) + length_error)
    got = decode_or_wire_error(raw_message(blob, data, length=length))
    if got is not None:  # a valid message: its tensors tile the data section
        assert sum(t.numel() * t.element_size() for t in got.values()) == len(blob) + len(data) - length


def _mutate(header: dict, name: str, how: str) -> dict | list:
    entry = header[name]
    itemsize = {n: d.itemsize for n, d in zip(DTYPE_NAMES, DTYPES)}[entry["dtype"]]
    begin, end = entry["data_offsets"]
    changes = {
        "dtype_other_size": {"dtype": next(n for n, d in zip(DTYPE_NAMES, DTYPES) if d.itemsize != itemsize)},
        "dtype_unknown": {"dtype": "Q7"},
        "shape_grow": {"shape": [*entry["shape"], 2]},
        "shape_negative": {"shape": [-1, *entry["shape"]]},
        "offsets_shift": {"data_offsets": [begin + 1, end + 1]},
        "offsets_shrink": {"data_offsets": [begin, end - 1]},
        "offsets_missing": {"data_offsets": None},
    }
    if how == "not_a_dict":
        return [header]
    if how == "metadata_not_str":
        return {**header, "__metadata__": {"k": 1}}
    return {**header, name: {**entry, **changes[how]}}


@FAST
@given(
    st.dictionaries(names, tensors(), min_size=1, max_size=3),
    st.data(),
    st.sampled_from(
        [
            "dtype_other_size",
            "dtype_unknown",
            "shape_grow",
            "shape_negative",
            "offsets_shift",
            "offsets_shrink",
            "offsets_missing",
            "not_a_dict",
            "metadata_not_str",
        ]
    ),
)
def test_lying_header_rejected(tensors, data, how):
    frames = [bytes(f) for f in encode(tensors)]
    header = json.loads(frames[0][8:])
    name = data.draw(st.sampled_from(sorted(header)))
    if how in ("dtype_other_size", "shape_grow", "offsets_shift", "offsets_shrink"):  # empties may sit anywhere
        assume(tensors[name].numel() > 0)
    blob = json.dumps(_mutate(header, name, how)).encode()
    with pytest.raises(WireError):
        decode([struct.pack("<Q", len(blob)) + blob, *frames[1:]])


@SOME
@given(st.dictionaries(names, tensors(), min_size=1, max_size=3), st.data())
def test_header_frame_moved_rejected(tensors, data):
    frames = [bytes(f) for f in encode(tensors)]
    assume(len(frames) > 1)
    order = data.draw(st.permutations(range(len(frames))))
    assume(order[0] != 0)
    with pytest.raises(WireError):
        decode([frames[i] for i in order])


@SOME
@given(st.dictionaries(names, tensors(), min_size=1, max_size=3), st.data())
def test_random_truncation_or_extension_rejected(tensors, data):
    frames = [bytes(f) for f in encode(tensors)]
    i = data.draw(st.integers(0, len(frames) - 1))
    if data.draw(st.booleans()):
        assume(len(frames[i]) > 0)
        frames[i] = frames[i][: data.draw(st.integers(0, len(frames[i]) - 1))]
    else:
        frames[i] += data.draw(st.binary(min_size=1, max_size=9))
    with pytest.raises(WireError):
        decode(frames)


def test_fp8_travels_under_safetensors_name_and_its_size_is_checked():
    q = torch.randn(2, 3, 8).to(torch.float8_e4m3fn)
    frames = encode({"h": q, "h_scale": torch.rand(2, 3, 1)})
    header = json.loads(bytes(frames[0])[8:])
    assert header["h"]["dtype"] == "F8_E4M3" and header["h"]["data_offsets"][1] - header["h"]["data_offsets"][0] == 48
    loaded = safetensors.torch.load(b"".join(bytes(f) for f in frames))
    assert loaded["h"].dtype == torch.float8_e4m3fn and torch.equal(bits(loaded["h"]), bits(q))
    lying = raw_message({"h": {"dtype": "F8_E4M3", "shape": [2, 3, 8], "data_offsets": [0, 96]}}, bytes(96))
    with pytest.raises(WireError, match=r"F8_E4M3\[2, 3, 8\] needs 48 bytes"):
        decode(lying)


def test_frame_size_bench_checks_every_frame_it_times(tmp_path):
    """benchmarks/bench_frame_size.py, for correctness only (its figures are in BENCHMARKS.md, "Frames of
    1 MiB"): both sizes timed, every message's frames checked as they land and the last one byte for byte."""
    out = tmp_path / "frames.json"
    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_frame_size.py"
    proc = subprocess.run([sys.executable, str(bench), "--frames-kib", "1024,256", "--message-mib", "4", "--gib",
                           "0.04", "--rounds", "2", "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["ok"] and sorted(report["figures"]) == ["1024", "256"]
    assert all(f["verified"] and f["messages"] == 10 for figs in report["figures"].values() for f in figs)
    assert len(report["summary"]["256"]["over_1024_kib"]) == 2
