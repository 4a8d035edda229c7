"""What a worker serves (``TargetInfo``): plain data, no torch, so the broker can compare workers' targets
without importing torch. Part of the contract (``contract.py``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class TargetInfo:
    """What a worker serves; checked by the client at setup."""

    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    aux_layer_ids: tuple[int, ...]
    dspark_layer_ids: tuple[int, ...]
    model_name: str
    dtype: str
    engine: str
    fingerprint: str

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        d["dspark_layer_ids"] = list(self.dspark_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TargetInfo:
        fields = {f.name for f in dataclasses.fields(cls)}
        missing = fields - set(d)
        if missing:
            raise ValueError(f"target info lacks fields {sorted(missing)}")
        kw = {k: d[k] for k in fields}
        kw["aux_layer_ids"] = tuple(int(i) for i in kw["aux_layer_ids"])
        kw["dspark_layer_ids"] = tuple(int(i) for i in kw["dspark_layer_ids"])
        return cls(**kw)

    def mismatches(self, other: TargetInfo | Mapping[str, Any], *, ignore: Sequence[str] = ()) -> dict[str, tuple]:
        """Fields whose values differ, as ``{field: (ours, theirs)}``.

        ``other`` may be a partial mapping: only the fields it names are compared.
        """
        theirs = other.to_dict() if isinstance(other, TargetInfo) else dict(other)
        ours = self.to_dict()
        out = {}
        for k, v in theirs.items():
            if k in ignore:
                continue
            if k not in ours:
                raise ValueError(f"unknown target info field {k!r}")
            a = list(v) if isinstance(v, (tuple, list)) else v
            if ours[k] != a:
                out[k] = (ours[k], a)
        return out
