"""The bytes of one cache entry, and the digest it carries (checked on every read).

An entry::

    ENTRY_MAGIC (4) | key (16) | digest (16) | body length (u64 LE) | 4 zero bytes | body

The body is a safetensors file (``spec_serve.protocol.wire``: a JSON header, then the tensors' bytes)
of the row's stored tensors, its metadata the stored kind, its token count and its codec. The digest
is BLAKE2b-128 over the key, the body's header and the wrapping 32-bit word sum of each tensor's bytes
(``spec_serve.protocol.digest.tensor_digest``, memory-bandwidth fast, where hashing every byte with
BLAKE2b would cap reads near 1 GB/s a core). So a changed header byte (a shape, an offset) is caught
as a hash would catch it, and the tensors' bytes as the reply digest catches them: any change confined
to one word, a truncated or zeroed tail, another entry's bytes (unnoticed with probability 2**-32);
not words permuted within a tensor (docs/cache.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Mapping

import torch

from spec_serve.protocol import digest, wire
from spec_serve.protocol.wire_format import WireError

ENTRY_MAGIC = b"SSC1"
ENTRY_HEAD = struct.Struct("<4s16s16sQ4x")  # 48 bytes: the body starts 16-aligned (tensor views)
DIGEST_BYTES = 16


class BadEntry(ValueError):
    """An entry that must not be returned: torn, corrupt, of another key, or not an entry at all."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """A decoded entry: ``tensors`` are read-only views of the bytes read."""

    key: bytes
    kind: str
    tokens: int
    codec: str
    tensors: dict[str, torch.Tensor]


def _digest(key: bytes, header: bytes, tensors: Mapping[str, torch.Tensor]) -> bytes:
    sums = [digest.tensor_digest(t) for t in tensors.values()]
    words = struct.pack(f"<{len(sums)}I", *(int(s) & 0xFFFFFFFF for s in sums))
    return hashlib.blake2b(key + header + words, digest_size=DIGEST_BYTES).digest()


def encode_parts(key: bytes, kind: str, tokens: int, codec: str,
                 tensors: Mapping[str, torch.Tensor]) -> list[bytes | memoryview]:
    """The entry's bytes as consecutive parts (CPU ``tensors``): its head, then the body's frames, views of
    the tensors (no copy; written with one ``writev``)."""
    frames = wire.encode(dict(tensors), {"kind": kind, "tokens": str(tokens), "codec": codec})
    length = sum(memoryview(f).nbytes for f in frames)
    head = ENTRY_HEAD.pack(ENTRY_MAGIC, key, _digest(key, bytes(frames[0]), tensors), length)
    return [head, *(memoryview(f).cast("B") for f in frames)]


def encode(key: bytes, kind: str, tokens: int, codec: str, tensors: Mapping[str, torch.Tensor]) -> bytes:
    """The entry's bytes, in one piece."""
    return b"".join(encode_parts(key, kind, tokens, codec, tensors))


def decode(data: bytes | memoryview, key: bytes | None = None) -> Entry:
    """The entry in ``data`` (exactly one entry's bytes), checked: ``BadEntry`` if it is torn, fails its
    digest, or (``key`` given) belongs to another key."""
    if len(data) < ENTRY_HEAD.size:
        raise BadEntry(f"torn entry: {len(data)} bytes")
    magic, own_key, want, length = ENTRY_HEAD.unpack_from(data)
    if magic != ENTRY_MAGIC:
        raise BadEntry("not an entry (bad magic)")
    if key is not None and own_key != key:
        raise BadEntry("an entry of another key")
    body = memoryview(data)[ENTRY_HEAD.size:]
    if len(body) != length:
        raise BadEntry(f"torn entry: body of {len(body)} bytes, {length} expected")
    try:
        header_len = struct.unpack_from("<Q", body)[0] + 8
        tensors, meta = wire.decode_with_metadata([body[:header_len], body[header_len:]])
        entry = Entry(own_key, meta["kind"], int(meta["tokens"]), meta["codec"], tensors)
    except (WireError, KeyError, ValueError, struct.error) as e:
        raise BadEntry(f"unreadable entry body: {e}") from None
    if _digest(own_key, bytes(body[:header_len]), tensors) != want:
        raise BadEntry("entry fails its digest")
    return entry
