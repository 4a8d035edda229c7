"""One cached row: its key, its real span, and its stored form (what the cache keeps of a reply row).

A row is cacheable when its ``attention_mask`` is right-padded (a run of ones, then zeros): its real
span is ``[0, L)``, and what a padded forward computes there depends on nothing but its ``L`` token
ids (causal attention, positions from 0). Its key is a digest of the target's fingerprint, the stored
kind and its layer ids, the storage codec, and those ``L`` ids; never the vocab mapping (a compact
EAGLE-3 row is expanded with whatever mapping is current) nor the loss mask (the stored tensors do not
depend on it; ``input_ids`` and ``loss_mask`` of a returned row are the caller's own, shifted as the
contract shifts them).

What is stored per row, over its span only (docs/cache.md):

- EAGLE-3 (kind ``eagle3_compact``): ``aux_hidden_states [L, 3H]``, ``last_hidden_states [L, H]``,
  ``argmax_ids [L]``, with ``argmax_ids[L-1] = 0`` (the next token is padding);
- DSpark: ``target_hidden_states [L, kH]``, ``target_last_hidden_states [L, H]``.

Read back into a padded ``[B, S]`` batch, the positions past a row's span hold zeros (argmax 0), as
packed replies do (docs/packing.md). With the ``fp8`` codec the hidden states the wire sends FP8
(``contract.FP8_TENSORS``: not compact's final state, from which target_probs are computed) are stored as
float8_e4m3fn with one float32 scale per token and layer (``spec_serve/supervision/fp8.py``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch

from spec_serve.supervision import fp8
from spec_serve.supervision.contract import FP8_TENSORS, Kind, right_padded_rows
from spec_serve.supervision.target_info import TargetInfo

KEY_BYTES = 16
# How rows are stored: "native" keeps the reply's bytes (bit-equal on read); "fp8" as the module says.
CODECS = ("native", "fp8")
# Each codec's name in the keys. "fp8.2": compact's final state kept native; entries of the first fp8 (which
# quantized it too) are not found by these keys and leave with eviction.
CODEC_KEYS = {"native": "native", "fp8": "fp8.2"}
# The stored tensors per stored kind (those with a sequence dim first, [L, ...]); the rest of a returned
# batch, input_ids and loss_mask, is the caller's.
STORED: dict[Kind, tuple[str, ...]] = {
    Kind.EAGLE3_COMPACT: ("aux_hidden_states", "last_hidden_states", "argmax_ids"),
    Kind.DSPARK: ("target_hidden_states", "target_last_hidden_states"),
}
ARGMAX = "argmax_ids"
SCALE_SUFFIX = ".fp8_scale"


def stored_kind(kind: Kind) -> Kind:
    """What the cache keeps for a request of ``kind``: EAGLE-3 as its compact form, the rest as they are."""
    return Kind.EAGLE3_COMPACT if kind is Kind.EAGLE3 else kind


def row_spans(attention_mask: torch.Tensor) -> list[int | None]:
    """Per row, its real length ``L`` if it is right-padded with at least one real token, else None
    (left padding, holes, an empty row: served, never cached)."""
    mask = attention_mask.to("cpu") != 0
    lengths = mask.sum(dim=1)
    cacheable = right_padded_rows(mask) & (lengths > 0)
    return [int(n) if ok else None for n, ok in zip(lengths.tolist(), cacheable.tolist())]


def key_prefix(info: TargetInfo, kind: Kind, codec: str) -> bytes:
    """What every key of one (target, stored kind, layer ids, codec) shares."""
    layers = info.dspark_layer_ids if kind is Kind.DSPARK else info.aux_layer_ids
    text = f"spec-serve-cache/1|{info.fingerprint}|{kind.value}|{','.join(map(str, layers))}|{CODEC_KEYS[codec]}|"
    return text.encode()


def row_key(prefix: bytes, token_ids: torch.Tensor) -> bytes:
    """The key of a row whose real tokens are ``token_ids`` (``[L]``, any integer dtype)."""
    ids = token_ids.to("cpu", torch.int64).contiguous()
    return hashlib.blake2b(prefix + ids.numpy().tobytes(), digest_size=KEY_BYTES).digest()


def normalize_rows(batch: Mapping[str, torch.Tensor], spans: Sequence[int | None]) -> None:
    """In place: the stored tensors of each cacheable row zero past its span (and ``argmax_ids`` at its
    last real position, whose next token is padding): the form every cached row is returned in."""
    for i, length in enumerate(spans):
        if length is None:
            continue
        for name, t in batch.items():
            if name in STORED[Kind.EAGLE3_COMPACT] + STORED[Kind.DSPARK]:
                t[i, length:].zero_()
                if name == ARGMAX:
                    t[i, length - 1] = 0


def encode_row(row: Mapping[str, torch.Tensor], codec: str, hidden: int) -> dict[str, torch.Tensor]:
    """A row's stored tensors (``[L, ...]``, or a batch of rows ``[n, S, ...]``; on any device) as kept on
    disk under ``codec``; ``hidden``: the target's hidden size (fp8 takes one scale per token and layer: a
    last dim of ``kH`` is ``k`` layers)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in row.items():
        if codec == "native" or name not in FP8_TENSORS:
            out[name] = t.contiguous()
            continue
        q, scale = fp8.quantize_blocks(t, hidden)
        # Kept as uint8, the stored format since the first fp8 caches (the wire codec has since learnt F8_E4M3,
        # but entries already written must read the same); its scale's name says what it is.
        out[name], out[name + SCALE_SUFFIX] = q.view(torch.uint8), scale
    return out


def decode_row(stored: Mapping[str, torch.Tensor], dtype: torch.dtype, hidden: int) -> dict[str, torch.Tensor]:
    """The row's tensors from what ``encode_row`` kept: fp8 ones dequantized to ``dtype``."""
    out = {}
    for name, t in stored.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = stored.get(name + SCALE_SUFFIX)
        if scale is None:
            out[name] = t
            continue
        if scale.shape[-1] * hidden != t.shape[-1]:
            raise ValueError(f"a stored {name} of shape {tuple(t.shape)} has fp8 scales of shape "
                             f"{tuple(scale.shape)}, not one per {hidden} elements")
        out[name] = fp8.dequantize_blocks(t.view(fp8.FP8_DTYPE), scale, dtype)
    return out


def check_row(row: Mapping[str, torch.Tensor], kind: Kind, length: int) -> None:
    """``ValueError`` unless ``row`` (fp8 scales aside) holds exactly ``kind``'s stored tensors with ``length``
    positions."""
    row = {name: t for name, t in row.items() if not name.endswith(SCALE_SUFFIX)}
    if sorted(row) != sorted(STORED[kind]) or any(t.shape[0] != length for t in row.values()):
        shapes = {name: list(t.shape) for name, t in row.items()}
        raise ValueError(f"a cached {kind.value} row of {length} tokens holds {shapes}")
