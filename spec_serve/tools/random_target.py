"""A weightless target directory for benchmarks: ``config.json`` plus a seed, no weights.

HFTarget builds such a target with random weights straight on its device (``RANDOM_INIT_FILE``
in :mod:`spec_serve.engines.hf`), so a benchmark of a large model's shape needs no download and
no disk write of weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from spec_serve.engines.hf import RANDOM_INIT_FILE


def write_random_init_target(out_dir: str | Path, config: dict, seed: int = 0) -> Path:
    """Write a weightless target dir: ``config.json`` and a marker with the init seed."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({"seed": torch.tensor([seed], dtype=torch.int64)}, str(out / RANDOM_INIT_FILE),
              metadata={"spec_serve": "random_init"})
    return out
