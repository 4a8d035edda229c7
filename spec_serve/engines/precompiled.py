"""Batch classes compiled ahead of time and saved whole: a warm start that traces nothing.

Through ``torch.compile`` alone, a restarted process loads its kernels from Inductor's cache but still traces
every batch class with dynamo (that cache holds Inductor's output, not dynamo's graphs and guards): most of a warm
start. torch's ahead-of-time compile (``torch.compile(...).aot_compile``) captures one call's whole graph and
returns a function that is saved with its guards and compiled code, and loaded by another process without tracing.
Here each load-time batch class (``compiled.WARMUP``) of a decoder layer class is one such function: compiled on
the first layer call of that class's warm-up forward, and saved; or loaded, where a load of the same model on the
same software saved it before.

Dispatch: a compiled layer's forward tries its class's functions by their guards (dynamo's own checks of a call:
which sizes are 1, which arguments are None, the attention function, the grad mode), the one that matched last
first. A call none admits (a batch outside the classes) goes to the dynamo-compiled forward, which compiles it: a
recompile, as without this module. Guards that cannot be saved (on globals and builtins) are left out, as torch
leaves them out by default; what they checked (the model's code, torch) is in the directory's key instead
(``compiled._store_key``). Each class is captured on its own, from no history, so a class's graph is the same in
every process whatever ran before it.

The files are written whole (atomically) and read by ``torch.compiler.load_compiled_function``, which unpickles
them: the directory must be as trusted as Inductor's own cache, which holds code that runs too. A file that does
not load (another torch, truncated) is compiled again and replaced. Only backends whose output torch can save take
this way (``SAVABLE_BACKENDS``); others, and a torch without ``aot_compile``, trace as before.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from spec_serve.telemetry.logs import event, one_line

log = logging.getLogger("spec_serve.engines.compiled")

# The backends whose output torch saves, from which torch: AOTAutograd's aot_eager only from 2.13 (torch 2.11 on
# the GPU machine refused it: "expected OutputCode, got <class 'function'>").
SAVABLE_BACKENDS = {"inductor": (2, 11), "aot_eager": (2, 13)}
SUFFIX = ".aot"
# The name the saved functions give the layer class's forward: pickle cannot refer to it by its qualified name,
# which names the decorated function, so each process hands over its own.
FORWARD_KEY = "layer_forward"

# (function, args, kwargs) -> an ahead-of-time compiled function of ``function`` for calls like that one
Compiler = Callable[[Callable[..., Any], tuple, dict], Any]


def unavailable_reason(backend: str) -> str | None:
    """Why compiled classes cannot be saved here (then every load traces, as plain torch.compile does), or None."""
    load = getattr(torch.compiler, "load_compiled_function", None)
    function = getattr(getattr(torch._dynamo, "aot_compile", None), "AOTCompiledFunction", None)
    needed = ("guard_check", "disable_guard_check", "save_compiled_function")
    if load is None or function is None or not all(hasattr(function, n) for n in needed) \
            or "external_data" not in inspect.signature(load).parameters:
        return f"torch {torch.__version__} has no ahead-of-time compile this engine can use (torch 2.11 and 2.13 have)"
    since = SAVABLE_BACKENDS.get(backend)
    if since is None or _torch_version() < since:
        return f"the {backend} backend's output cannot be saved by torch {torch.__version__}"
    return None


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


class ClassFunctions:
    """The compiled functions of one decoder layer class, one per batch class, saved in ``directory``.

    ``warming`` names the batch class whose warm-up forward runs: its first layer call that no function admits loads
    that class's saved function, or compiles and saves it (``load_or_compile``); that happens inside the forward, so
    a loaded function's guards are rebuilt in the grad mode the layers run in (an inference-mode tensor lacks a
    dispatch key the guards check). Outside warm-ups such a call is the caller's to handle."""

    def __init__(self, layer_cls: type[torch.nn.Module], directory: Path, compiler: Compiler):
        self.forward = inspect.unwrap(layer_cls.forward)  # decorators only rename arguments
        self.directory, self.prefix, self._compiler = directory, layer_cls.__qualname__, compiler
        self.functions: list[Any] = []
        self._last = 0  # index of the function that admitted the last call
        self.warming: str | None = None
        self.loaded: list[str] = []
        self.compiled: list[str] = []
        self.failed: str | None = None  # why a class did not compile ahead of time: no more are tried
        self.issue: str | None = None  # the last reason a class was not loaded or not saved (also logged)
        self.load_seconds = 0.0  # spent reading and rebuilding saved functions
        self.missed: str | None = None  # why a call outside warm-ups was refused by every function (note_miss)

    def path(self, name: str) -> Path:
        return self.directory / f"{self.prefix}.{name}{SUFFIX}"

    def find(self, args: tuple, kwargs: dict) -> Any | None:
        """The function whose guards admit this call (``args`` begin with the layer), or None."""
        count = len(self.functions)
        for step in range(count):
            index = (self._last + step) % count
            if self.functions[index].guard_check(*args, **kwargs):
                self._last = index
                return self.functions[index]
        return None

    def load_or_compile(self, args: tuple, kwargs: dict) -> Any | None:
        """Batch class ``warming``'s function for this call: saved, if it loads and admits the call, else compiled
        now and saved; None if it does not compile (``failed`` says why: dynamo traces instead)."""
        name, self.warming = self.warming, None
        assert name is not None, "load_or_compile() outside a warm-up"
        function = self._load(name)
        if function is not None and function.guard_check(*args, **kwargs):
            self._add(function)
            self.loaded.append(name)
            return function
        if function is not None:
            reason = f"its guards refuse the warm-up's call ({refusal(function, args, kwargs)})"
            self.issue = f"{name}: {reason}"
            event(log, logging.INFO, "compile.saved_class_unusable", path=self.path(name), reason=reason,
                  action="compiling")
        return self._compile(name, args, kwargs)

    def note_miss(self, args: tuple, kwargs: dict) -> None:
        """A call outside warm-ups that no function admits (it goes to dynamo: a recompile, unless dynamo compiled
        such a call before): keep why the function that matched last refuses it, once until ``take_miss``. Not
        where a class failed to compile ahead of time: dynamo serves the classes from it on, every call a miss."""
        if self.missed is None and self.functions and self.failed is None:
            self.missed = refusal(self.functions[self._last], args, kwargs)

    def take_miss(self) -> str | None:
        """Why the last call no function admitted was refused (None if every call was admitted), and forget it."""
        missed, self.missed = self.missed, None
        return missed

    def _load(self, name: str) -> Any | None:
        path = self.path(name)
        if not path.exists():
            return None
        started = time.monotonic()
        try:
            with open(path, "rb") as f:
                return torch.compiler.load_compiled_function(f, external_data={FORWARD_KEY: self.forward})
        except Exception as e:  # whatever unpickling a stale or broken file raises: compile it again
            self.issue = f"{name}: {one_line(e)}"
            event(log, logging.INFO, "compile.saved_class_unusable", path=path, reason=one_line(e), action="compiling")
            return None
        finally:
            self.load_seconds += time.monotonic() - started

    def _compile(self, name: str, args: tuple, kwargs: dict) -> Any | None:
        """Compile for this call, add and save (a directory we cannot write only costs the next load a compile)."""
        try:
            function = self._compiler(self.forward, args, kwargs)
        except Exception as e:  # e.g. a graph break, which a whole-graph capture refuses: dynamo traces instead
            self.failed = one_line(e)
            self.issue = f"{name}: {self.failed}"
            event(log, logging.INFO, "compile.ahead_of_time_failed", batch_class=name, reason=self.failed,
                  effect="this and later classes are traced by dynamo at every load")
            return None
        self._add(function)
        self.compiled.append(name)
        path = self.path(name)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            function.save_compiled_function(str(path), external_data={FORWARD_KEY: self.forward})
        except Exception as e:  # OSError, or an object of this model torch cannot pickle
            self.issue = f"{name} unsaved: {one_line(e)}"
            event(log, logging.INFO, "compile.class_unsaved", path=path, reason=one_line(e),
                  effect="a restart compiles this class again")
        return function

    def _add(self, function: Any) -> None:
        function.disable_guard_check()  # find() checked them; calling checks them again otherwise
        self.functions.append(function)
        self._last = len(self.functions) - 1


def refusal(function: Any, args: tuple, kwargs: dict) -> str:
    """Which guards of ``function`` (ahead-of-time compiled) refuse this call, in dynamo's words (e.g. ``GLOBAL_STATE
    changed: num_threads``); "unknown" where this torch cannot say. Slow (dynamo's verbose check): for logs only."""
    try:
        parts = function._artifacts.guard_manager.check_verbose(function.prepare_f_locals(*args, **kwargs))
        return "; ".join(part.strip() for part in parts.verbose_code_parts) or "unknown"
    except Exception:  # a private API of torch's: a torch that moved it only loses the detail
        return "unknown"


class LayerForward:
    """A layer's forward through its class's saved or ahead-of-time compiled functions (``ClassFunctions``): the
    one whose guards admit the call, else (a class compiled now, in its warm-up, failing) ``traced``, the
    dynamo-compiled forward.

    It is the layer's ``forward`` attribute, and capturing a class's graph pickles the layer's attributes (into
    the guards' state): this one pickles as None, not as the compiled functions it holds (not picklable)."""

    def __init__(self, saved: ClassFunctions, layer: torch.nn.Module, traced: Callable[..., Any]):
        self.saved, self.layer, self.traced = saved, layer, traced

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = (self.layer, *args)
        function = self.saved.find(call, kwargs)
        if function is None and self.saved.warming is not None:
            function = self.saved.load_or_compile(call, kwargs)
        elif function is None:
            self.saved.note_miss(call, kwargs)
        return self.traced(*args, **kwargs) if function is None else function(*call, **kwargs)

    def __reduce__(self) -> tuple[Callable[[], None], tuple]:
        return _nothing, ()


def _nothing() -> None:
    return None
