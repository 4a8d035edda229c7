"""``spec-serve cache stats|verify|prune DIR``: what a cache directory holds, whether every entry passes its
digest, and trimming it (docs/cache.md)."""

from __future__ import annotations

import collections
import json
import os
import struct
import time
from pathlib import Path
from typing import Any

from spec_serve.cache import entry as entries
from spec_serve.cache.store import PARTIAL_SUFFIX, evict, published, read_index


def _segments(root: Path) -> list[Path]:
    directory = root / "segments"
    if not directory.is_dir():
        raise ValueError(f"{root} is not a spec-serve cache directory (no segments/ in it)")
    return [directory / name for name in published(directory)]


def _label(fd: int, offset: int) -> str:
    """``kind/codec`` of the entry at ``offset``, from its body's header alone."""
    head = os.pread(fd, entries.ENTRY_HEAD.size + 8, offset)
    header_len = struct.unpack_from("<Q", head, entries.ENTRY_HEAD.size)[0]
    header = json.loads(os.pread(fd, header_len, offset + entries.ENTRY_HEAD.size + 8))
    meta = header.get("__metadata__", {})
    return f"{meta.get('kind', '?')}/{meta.get('codec', '?')}"


def stats(root: str | Path) -> dict[str, Any]:
    """Entries, bytes, bytes per token (per stored kind and codec), partial files, and the hit rate the
    clients that closed recorded."""
    root = Path(root)
    keys: set[bytes] = set()
    per_label: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    entry_count, total_bytes, unreadable = 0, 0, []
    segments = _segments(root)
    for path in segments:
        try:
            records = read_index(path)
            total_bytes += path.stat().st_size
            with open(path, "rb") as f:
                for key, loc in records:
                    counts = per_label[_label(f.fileno(), loc.offset)]
                    counts["entries"] += 1
                    counts["bytes"] += loc.length
                    counts["tokens"] += loc.tokens
                    keys.add(key)
                    entry_count += 1
        except (OSError, ValueError) as e:
            unreadable.append(f"{path.name}: {e}")
    clients: collections.Counter[str] = collections.Counter()
    for path in (root / "stats").glob("*.json"):
        try:
            recorded = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        clients.update({k: recorded.get(k, 0) for k in ("hits", "misses", "hit_tokens", "miss_tokens", "corrupt")})
    asked = clients["hits"] + clients["misses"]
    return {
        "dir": str(root), "segments": len(segments), "entries": entry_count, "rows": len(keys),
        "bytes": total_bytes, "unreadable_segments": unreadable,
        "partial_files": len(list((root / "tmp").glob(f"*{PARTIAL_SUFFIX}"))),
        "kinds": {label: {**c, "bytes_per_token": c["bytes"] / max(1, c["tokens"])} for label, c in per_label.items()},
        "clients": {**clients, "hit_rate": clients["hits"] / asked if asked else None},
    }


def verify(root: str | Path) -> dict[str, Any]:
    """Read every entry of every segment and check its digest: counts, and one line per bad one."""
    checked, bad = 0, []
    for path in _segments(Path(root)):
        try:
            records = read_index(path)
        except (OSError, ValueError) as e:
            bad.append(f"{path.name}: {e}")
            continue
        with open(path, "rb") as f:
            for key, loc in records:
                checked += 1
                try:
                    entries.decode(os.pread(f.fileno(), loc.length, loc.offset), key)
                except entries.BadEntry as e:
                    bad.append(f"{path.name} @{loc.offset}: {e}")
    return {"checked": checked, "bad": bad}


def prune(root: str | Path, max_bytes: int | None, partials_older_than: float) -> dict[str, Any]:
    """Evict (oldest segments first) down to ``max_bytes``, and remove partial files of writers gone for
    ``partials_older_than`` seconds (a killed process's: nobody reads them)."""
    root = Path(root)
    _segments(root)
    evicted = evict(root / "segments", max_bytes) if max_bytes is not None else []
    removed = []
    for path in (root / "tmp").glob(f"*{PARTIAL_SUFFIX}"):
        try:
            if time.time() - path.stat().st_mtime > partials_older_than:
                path.unlink()
                removed.append(path.name)
        except FileNotFoundError:
            continue
    return {"evicted_segments": evicted, "removed_partials": removed}
