"""What a checkpoint directory says about itself, read without building its model.

Its identity (:func:`fingerprint`, the ``TargetInfo.fingerprint`` every engine reports for one
checkpoint), its dtype (:func:`parse_dtype`, :func:`resolve_dtype`) and named tensors from its
safetensors files (:func:`load_checkpoint_tensors`). Every engine reads a checkpoint through these,
so engines serving one checkpoint agree on what it is.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import torch

# Fingerprint reads this much from each end of every weight file (see `fingerprint`).
_FINGERPRINT_EDGE_BYTES = 1 << 20
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
# Config keys that say how or where a checkpoint was written, not what it computes.
_VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path")


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | str:
    """``None``/"auto" -> "auto" (the checkpoint's dtype); "bfloat16"/"bf16"/torch.bfloat16 -> torch.bfloat16."""
    if dtype is None or dtype == "auto":
        return "auto"
    if isinstance(dtype, torch.dtype):
        return dtype
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
    value = getattr(torch, aliases.get(dtype, dtype), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"unknown dtype {dtype!r}")
    return value


def resolve_dtype(path: str | Path, dtype: str | torch.dtype | None) -> torch.dtype:
    """``dtype`` as a torch dtype; ``None``/"auto" means the checkpoint's (float32 if it names none)."""
    parsed = parse_dtype(dtype)
    if isinstance(parsed, torch.dtype):
        return parsed
    config = json.loads((Path(path) / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    named = parse_dtype(name)
    if not isinstance(named, torch.dtype):  # the config's own dtype is "auto": nothing to resolve it to
        raise ValueError(f"{path}: config.json gives dtype {name!r}, not a torch dtype")
    return named


def fingerprint(path: str | Path) -> str:
    """A 32-hex-digit sha256 identity of a checkpoint directory's config and weights.

    Hashes the canonical config JSON (sorted keys, minus version/path stamps) and, for each weight
    file in name order: its name, size, its first and last MiB -- and, for safetensors, the whole
    JSON header (names, dtypes, shapes, offsets). Reading a few MiB per file keeps this cheap
    whatever the checkpoint's size; the edges of the data plus the exact sizes and layout tell
    different checkpoints apart in practice (a retrained or re-seeded model differs everywhere).
    """
    root = Path(path)
    h = hashlib.sha256()
    config = json.loads((root / "config.json").read_text())
    for key in _VOLATILE_CONFIG_KEYS:
        config.pop(key, None)
    h.update(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    weight_files = sorted(p for p in root.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    if not weight_files:
        raise ValueError(f"no weight files ({', '.join(_WEIGHT_SUFFIXES)}) in {root}")
    for wf in weight_files:
        size = wf.stat().st_size
        h.update(f"{wf.name}\0{size}\0".encode())
        with open(wf, "rb") as f:
            head_len = _FINGERPRINT_EDGE_BYTES
            if wf.suffix == ".safetensors" and size >= 8:
                head_len = max(head_len, 8 + int.from_bytes(f.read(8), "little"))
                f.seek(0)
            h.update(f.read(head_len))
            if size > head_len:
                f.seek(max(head_len, size - _FINGERPRINT_EDGE_BYTES))
                h.update(f.read())
    return h.hexdigest()[:32]


def load_checkpoint_tensors(path: str | Path, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """Read the named tensors (those present) from a checkpoint's safetensors files, on CPU."""
    from safetensors import safe_open

    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({weight_map[n] for n in names if n in weight_map})
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights for {list(names)} in {root}")
    out: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(root / name), framework="pt", device="cpu") as f:
            for key in set(names) & set(f.keys()):
                out[key] = f.get_tensor(key)
    return out
