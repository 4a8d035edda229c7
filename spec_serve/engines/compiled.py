"""Regional compilation of a causal LM's decoder layers (``HFTarget(compile=True)``, ``--compile``).

What is compiled: the ``forward`` of every decoder layer, through one ``torch.compile``'d function per
layer class bound to each layer. Dynamo caches compiled code per code object, and with nn.Module
parameters traced as inputs every layer of a class matches the same entry: the first layer's compile
serves all N layers, so start-up costs one layer's compile, not N (and a second compiled engine of the
same model in the process compiles nothing). The engine's capture hooks sit in the module call around
``forward``, so they stay eager and record the compiled outputs.

Attention is traced with the rest: padded batches run the model's own attention function (SDPA, called from the
graph), with flash or memory-efficient kernels and never cuDNN's (``packing.any_length_attention``, at load and in
every forward: cuDNN plans each new sequence length anew, so a worker's first batches of new lengths would run
slower than the same lengths later); right-padded rows come without their padding mask (``HFTarget._model_mask``),
so they run flash's causal kernel as full rows do; packed sequences run packing's ``rows_sdpa``, one custom op
whatever the number of rows. What Inductor fuses is what lies around the matmuls and attention: RMSNorm, RoPE,
residual adds, SiLU * up.

Shapes are dynamic from the first compile (``dynamic=True``), except sizes 0 and 1, which dynamo
always specialises, and what the graph branches on (whether there is a padding mask). So a graph is
chosen by the class of a batch (several rows or one; padding or none; padded or packed), never by the
history of shapes. ``WARMUP`` compiles those classes at load with fixed shapes in a fixed order (an engine
that never packs leaves out ``packed``, the last). Each is compiled ahead of time on its own and saved whole
(precompiled.py), so every process that compiles the same model compiles the same graphs, and a later load
of them loads the same compiled code: a compiled colocated target and a compiled worker compute bit-equal
results (Inductor's deterministic mode, where the torch has it, keeps on-device benchmarking from choosing
other reduction kernels in another process). Where classes are not saved (SAVE_CLASSES_ENV, a torch without
ahead-of-time compile) dynamo traces them, and then the graphs also depend on what it traced for that layer's
code in the process before (it names a graph's shape symbols after earlier traces). A batch outside those
classes (a sequence of one token) compiles through dynamo when it first comes: a recompile, logged and counted.

Start-up: one eager forward first (``device_seconds``: the device and library initialisation an eager
engine pays on its first batch), then the classes, each timed, and the time split into phases
(``CompileReport.phases``: tracing, the backend, guards, loading saved classes; ``other`` is the forwards
themselves and one-time set-up such as imports). A warm load (every class saved) traces nothing.

Numerics: fused kernels keep intermediates in float32 and round once, where eager rounds after each
op; that is one or two roundings of the model dtype per fused op, the same kind and size of
perturbation as a batch of another composition gets from its GEMM kernels. ``TOLERANCE`` states the
bound, docs/compile.md derives it.

Caches: the saved classes, and Inductor's FX graph cache and AOTAutograd cache (on by default in torch), under
``TORCHINDUCTOR_CACHE_DIR`` (default ``/tmp/torchinductor_$USER``): a restarted process loads the classes,
or where one is missing, at least its kernels, instead of generating and compiling them. Once a load has
compiled its classes, a manifest under ``spec_serve/`` in that directory records them, in order, for this
model, dtype, device and torch; a later load of those classes or the first of them expects cache hits and
starts no pool of compile workers
(Inductor would otherwise start one process per core, each importing torch, only to load kernels; should
something miss after all, it is compiled in this process).

Fail soft: anything that stops compilation (no C++ compiler for CPU code, no Triton for CUDA code,
an error while tracing or generating code, at load or on a later recompile) puts the layers back to
eager with one WARNING naming the reason; the engine goes on serving eager.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import json
import logging
import os
import shutil
import sys
import time
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from spec_serve.engines import packing, precompiled
from spec_serve.telemetry.logs import event, one_line

log = logging.getLogger("spec_serve.engines.compiled")

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
# The batch classes compiled at load, by name, as (rows, tokens a row, padding, packed): several rows or one,
# each full or with padding, and a packed sequence of several rows. Sizes are fixed so that every process
# compiles the same graphs, and large enough that Inductor's size hints describe real batches.
WARMUP: dict[str, tuple[int, int, bool, bool]] = {
    "rows": (2, 256, False, False), "rows_padded": (2, 256, True, False), "row": (1, 256, False, False),
    "row_padded": (1, 256, True, False), "packed": (2, 256, True, True)}

# Dynamo keeps at most ``recompile_limit`` (8) graphs per code object and then runs that code eagerly,
# silently. Compiled engines of one model class in one process share the decoder layer's code object: each
# shape of model, dtype, device and backend adds its WARMUP classes, so the limit is raised to this (never
# lowered).
RECOMPILE_LIMIT = 64

# The attention kernels a class's graph may call (packing.any_length_attention, under which every class compiles and
# serves): in the store key, so that classes traced with another choice (cuDNN's, before) are not loaded.
ATTENTION_KERNELS = "flash,efficient,math"

# The same rounding class as packing (docs/compile.md derives why): by the model's dtype, each tensor
# against the eager padded forward, over real positions (``packing.compare``).
TOLERANCE = packing.TOLERANCE

# Dynamo's timers (``torch._dynamo.utils.compilation_time_metrics``) behind each phase of CompileReport.phases:
# a phase is the longest of its timers (a traced class runs the AOT dispatcher inside call_user_compiler, a class
# compiled ahead of time runs it alone). The three phases do not overlap; with ``load`` (saved classes read, not
# a dynamo timer) what the load took besides them is ``other``.
PHASE_TIMERS = {"trace": ("bytecode_tracing",),
                "backend": ("OutputGraph.call_user_compiler", "create_aot_dispatcher_function"),
                "guards": ("build_guards",)}
MANIFEST_DIR = "spec_serve"
# 0: compile every load's classes through dynamo, saving none (torch's ahead-of-time compile is experimental: the
# way back should it misbehave). Default 1: saved and loaded whole where torch can (precompiled.py).
SAVE_CLASSES_ENV = "SPEC_SERVE_COMPILE_SAVE_CLASSES"


@dataclasses.dataclass
class CompileReport:
    """What compiling did: for logs, metrics, the bench, and callers (``HFTarget.compile_report``)."""

    active: bool = False  # compiled layers serve; False: eager (``reason`` says why)
    reason: str | None = None
    seconds: float = 0.0  # the load-time compile: the warm-up forwards of WARMUP
    graphs: int = 0  # graphs dynamo compiled at load (0: another engine of this process had compiled them)
    recompiles: int = 0  # forwards after load that compiled graphs (a shape outside WARMUP)
    recompile_seconds: float = 0.0  # what those forwards took
    recompile_reason: str | None = None  # the guards of the saved classes that refused the last recompile's call
    cache_hits: int = 0  # Inductor FX graph cache hits at load: kernels loaded, not generated
    cache_misses: int = 0
    cache_dir: str = ""
    deterministic: bool = False  # Inductor's deterministic mode was on
    device_seconds: float = 0.0  # the eager forward before compiling (not in ``seconds``)
    classes: dict[str, float] = dataclasses.field(default_factory=dict)  # seconds per WARMUP class, in order
    phases: dict[str, float] = dataclasses.field(default_factory=dict)  # ``seconds`` split (_phases)
    manifest: bool = False  # a manifest said the cache holds every class: no compile-worker pool at load
    saved_classes: str | None = None  # where compiled classes are saved and loaded whole (precompiled.py), or None
    saved_classes_off: str | None = None  # why they are not (every load traces its classes)
    loaded: int = 0  # classes loaded whole at load: compiled before, saved, nothing traced
    saved_classes_issue: str | None = None  # the last reason a class was not loaded or saved (logged as it happened)


def unavailable_reason(device: torch.device) -> str | None:
    """Why torch.compile cannot run here (checked before trying, so the reason is clear), or None."""
    if not torch._dynamo.is_dynamo_supported():
        return f"torch.compile does not support this Python ({sys.version.split()[0]}) with torch {torch.__version__}"
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return "Inductor's CUDA code needs Triton, which is not installed (pip install triton)"
    elif device.type == "cpu":
        cxx = os.environ.get("CXX") or torch._inductor.config.cpp.cxx[1] or "g++"
        if shutil.which(cxx) is None:
            return f"Inductor's CPU code needs a C++ compiler, and {cxx!r} is not on PATH (install g++, or set CXX)"
    return None


def compile_error(exc: BaseException) -> bool:
    """Whether ``exc`` is compilation failing (tracing, code generation, a compiler), not the forward."""
    return isinstance(exc, torch._dynamo.exc.TorchDynamoException)


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _cache_lookups() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_hit"]), int(counters["inductor"]["fxgraph_cache_miss"])


def _timers() -> dict[str, float]:
    """Seconds dynamo has spent so far under each timer of PHASE_TIMERS (process-wide totals)."""
    from torch._dynamo.utils import compilation_time_metrics

    return {timer: sum(compilation_time_metrics.get(timer, ())) for timers in PHASE_TIMERS.values() for timer in timers}


def _phases(before: dict[str, float], seconds: float, load: float) -> dict[str, float]:
    """``seconds`` split by phase since the timers read ``before``; ``load``: seconds spent loading saved classes."""
    now = _timers()
    spent = {phase: round(max(now[timer] - before[timer] for timer in timers), 2)
             for phase, timers in PHASE_TIMERS.items()}
    spent["load"] = round(load, 2)
    return {**spent, "other": round(max(seconds - sum(spent.values()), 0.0), 2)}


def _options() -> dict[str, Any]:
    """Inductor options for our compile: deterministic mode where this torch has it (compile-time
    options: they are baked into the generated kernels, and change nothing else in the process)."""
    return {"deterministic": True} if hasattr(torch._inductor.config, "deterministic") else {}


def _tracing_config() -> dict[str, Any]:
    """Dynamo settings while our graphs are traced: float attributes (norm epsilons, the attention scale) as
    constants, as a static compile has them. Left dynamic (torch 2.13's default) they are turned into
    tensors, which restarts the trace of every graph (twice the tracing time) for no gain: they never vary."""
    return {"specialize_float": True} if hasattr(torch._dynamo.config, "specialize_float") else {}


def _bound(forward: Callable[..., Any], layer: torch.nn.Module, config: dict[str, Any]) -> Callable[..., Any]:
    """``forward`` (the compiled function) as ``layer``'s own, called under the dynamo ``config``."""
    if not config:
        return types.MethodType(forward, layer)

    def call(*args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(config):
            return forward(layer, *args, **kwargs)

    return call


def _ahead_of_time(backend: dict[str, Any], config: dict[str, Any]) -> precompiled.Compiler:
    """How ``precompiled`` compiles a class: one whole graph (``fullgraph``) with our backend and dynamo config."""

    # torch 2.11 has the API behind a flag, off by default; torch 2.13 has it on.
    flag = {"enable_aot_compile": True} if hasattr(torch._dynamo.config, "enable_aot_compile") else {}

    def compile_ahead(function: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        with torch._dynamo.config.patch({**config, **flag}):
            whole = torch.compile(function, dynamic=True, fullgraph=True, **backend)
            return whole.aot_compile((args, kwargs))  # type: ignore[attr-defined]  # torch >= 2.10

    return compile_ahead


def _saved_classes_off() -> str | None:
    """Why this load's classes are not saved and loaded whole (precompiled.py), or None."""
    if os.environ.get(SAVE_CLASSES_ENV, "1") == "0":
        return f"{SAVE_CLASSES_ENV}=0"
    if os.environ.get(TEST_FAULT_ENV):
        return f"{TEST_FAULT_ENV} puts a failing backend in the compiler's place"
    return precompiled.unavailable_reason(_backend_name())


# Test-only hooks (tests/worker/test_compile.py), read at load:
#   SPEC_SERVE_TEST_COMPILE_FAULT=load|recompile  every compile fails ("load"), or every one after load (the
#       warm-up's succeed); raised in the backend's place, so dynamo reports it as any backend failure, and the
#       fall back to eager is testable at load and while serving
#   SPEC_SERVE_TEST_COMPILE_BACKEND=NAME  a dynamo backend in Inductor's place (eager, aot_eager): tests of the
#       plumbing trace the real graphs without generating and building C++
#   SPEC_SERVE_TEST_COMPILE_CLASSES=a,b   compile only these WARMUP classes at load
TEST_FAULT_ENV = "SPEC_SERVE_TEST_COMPILE_FAULT"
TEST_BACKEND_ENV = "SPEC_SERVE_TEST_COMPILE_BACKEND"
TEST_CLASSES_ENV = "SPEC_SERVE_TEST_COMPILE_CLASSES"


def _backend_name() -> str:
    return os.environ.get(TEST_BACKEND_ENV) or "inductor"


def _classes(packed: bool) -> dict[str, tuple[int, int, bool, bool]]:
    """The WARMUP classes this load compiles, in WARMUP's order: all, unless TEST_CLASSES_ENV names some, and
    without ``packed`` for an engine that never runs packed forwards (``packed`` False). ``packed`` is last in
    WARMUP, so leaving it out changes none of the other graphs."""
    names = [n for n in os.environ.get(TEST_CLASSES_ENV, "").split(",") if n]
    unknown = sorted(set(names) - WARMUP.keys())
    if unknown:
        raise ValueError(f"{TEST_CLASSES_ENV} names no WARMUP class: {unknown}; the classes: {list(WARMUP)}")
    return {n: shape for n, shape in WARMUP.items()
            if (not names or n in names) and (packed or not shape[3])}


def _backend(options: dict[str, Any], loaded: Callable[[], bool]) -> dict[str, Any]:
    """``torch.compile`` keywords choosing the backend: Inductor with ``options`` (or TEST_BACKEND_ENV's); under
    TEST_FAULT_ENV that backend behind a failure (``loaded``: whether the load-time compile is done)."""
    name, fault = _backend_name(), os.environ.get(TEST_FAULT_ENV)
    if not fault:
        return {"backend": "inductor", "options": options} if name == "inductor" else {"backend": name}
    if fault not in ("load", "recompile"):
        raise ValueError(f"{TEST_FAULT_ENV} must be load or recompile, got {fault!r}")
    # What backend="inductor" builds, or the named backend.
    inner = torch._TorchCompileInductorWrapper(None, options, True) if name == "inductor" \
        else torch._dynamo.lookup_backend(name)

    def failing(graph, example_inputs):
        if fault == "load" or loaded():
            raise RuntimeError(f"a compile failed at {fault} ({TEST_FAULT_ENV})")
        return inner(graph, example_inputs)

    return {"backend": failing}


def _cache_dir() -> str:
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:  # an older torch: the directory is torch's default unless the environment names one
        return os.environ.get(CACHE_ENV, "torch's default")
    return cache_dir()


def _store_key(model: Any, layers: Sequence[torch.nn.Module], device: torch.device, backend: str) -> str:
    """What cached kernels and saved classes of ``model`` on ``device`` depend on, hashed: torch and transformers,
    the source of the layers' classes and of packing (its attention function is traced into the packed class),
    the model's configuration and dtype, the device (its kind and index), the backend and its options, and torch's
    math threads. Not the weights or the path: every target of one configuration shares the directory.

    The index and the threads because the saved guards check them at every call: a parameter's device (cuda:1 is
    not cuda:0), and dynamo's global state, which counts torch's intra-op threads (Inductor's CPU code is built for
    that many). A load at another count, keyed alike, would be refused by every saved class, compile them again and
    replace them, and the next load of the first count would do the same."""
    import transformers

    config = {k: v for k, v in model.config.to_dict().items() if k != "_name_or_path"}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    sources = sorted({_source_digest(type(layer)) for layer in layers} | {_source_digest(packing.PackedLayout)})
    key = json.dumps([torch.__version__, transformers.__version__, sources, config, str(next(model.parameters()).dtype),
                      name, str(device), torch.get_num_threads(), backend, _options(), ATTENTION_KERNELS],
                     sort_keys=True, default=str)
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def _source_digest(cls: type) -> str:
    """A digest of the file that defines ``cls`` (its name where the file cannot be read)."""
    try:
        return hashlib.sha256(Path(inspect.getfile(cls)).read_bytes()).hexdigest()[:16]
    except (OSError, TypeError):
        return cls.__qualname__


def _store(key: str) -> Path:
    """Where loads of the model keyed ``key`` keep what they compiled: the saved classes in this directory, the
    manifest of the classes compiled beside it (the same name with ``.json``)."""
    return Path(_cache_dir()) / MANIFEST_DIR / key


def _recorded(path: Path) -> list[str]:
    """The classes a manifest records, in the order they were compiled ([] without one)."""
    try:
        return list(json.loads(path.read_text())["classes"])
    except (OSError, ValueError, KeyError, TypeError):
        return []


def _cached(path: Path, classes: Sequence[str]) -> bool:
    """Whether the cache holds every graph of ``classes``: a load compiled them in this order, possibly with
    more after them (the graphs of a class depend on the classes traced before it, not after)."""
    recorded = _recorded(path)
    return recorded[:len(classes)] == list(classes)


def _record(path: Path, report: CompileReport) -> None:
    """Write the manifest, unless it already covers this load's classes (atomically; a cache directory we
    cannot write to only costs the next load a pool)."""
    if _cached(path, list(report.classes)):
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"torch": torch.__version__, "graphs": report.graphs, "seconds": report.seconds,
                                   "classes": report.classes}))
        tmp.replace(path)
    except OSError as e:
        event(log, logging.DEBUG, "compile.manifest_unwritten", path=path, reason=one_line(e))


def _no_compile_pool(expect_hits: bool) -> contextlib.AbstractContextManager[Any]:
    """Inductor with no pool of compile workers while a load that expects only cache hits runs (the
    option is not part of any cache key; later compiles get the pool as usual)."""
    return torch._inductor.config.patch(compile_threads=1) if expect_hits else contextlib.nullcontext()


class CompiledLayers:
    """The decoder ``layers`` of ``model`` compiled regionally (``install``), and undone (``fall_back``).

    ``warm_up(rows, tokens, padding, packed)`` runs one forward of that shape through the model (the engine's,
    under its forward lock); ``install`` calls it once eagerly, then for every ``WARMUP`` class, timing each.
    ``packed`` False: the engine never runs packed forwards (a worker without --packing), so the ``packed``
    class is not compiled at load (one would compile on first use, a recompile).
    """

    def __init__(self, model: Any, layers: Sequence[torch.nn.Module], name: str,
                 warm_up: Callable[[int, int, bool, bool], None], packed: bool = True):
        self.model, self.layers, self.name, self._warm_up = model, list(layers), name, warm_up
        self.packed = packed
        self.report = CompileReport(cache_dir=os.environ.get(CACHE_ENV) or "")
        self._saved: dict[type, precompiled.ClassFunctions] = {}  # by layer class, where classes are saved

    # -- load ------------------------------------------------------------------------------------

    def install(self, device: torch.device) -> CompileReport:
        """Compile the layers and warm every ``WARMUP`` shape class; on failure, eager with one WARNING."""
        reason = unavailable_reason(device)
        if reason is not None:
            self._fail(reason)
            return self.report
        classes, options = _classes(self.packed), _options() if _backend_name() == "inductor" else {}
        directory = _store(_store_key(self.model, self.layers, device, _backend_name()))
        manifest, saved_off = directory.with_suffix(".json"), _saved_classes_off()
        store = None if saved_off else directory
        started = time.monotonic()
        self._warm_up(*next(iter(classes.values())))  # eager: the device's own start-up, not compiling
        self.report = dataclasses.replace(self.report, deterministic=bool(options),
                                          manifest=_cached(manifest, list(classes)),
                                          saved_classes=None if store is None else str(store),
                                          saved_classes_off=saved_off,
                                          device_seconds=round(time.monotonic() - started, 2))
        event(log, logging.INFO, "compile.start", model=self.name, layers=len(self.layers), device=device,
              classes=",".join(classes), cache=_cache_dir(), deterministic=self.report.deterministic,
              manifest=self.report.manifest, saved_classes=store or f"off ({saved_off})")
        try:
            self._compile(classes, options, store)
        except Exception as e:
            if not compile_error(e):
                self._undo()
                raise
            self._fail(one_line(e))
            return self.report
        _record(manifest, self.report)
        event(log, logging.INFO, "compile.done", model=self.name, seconds=self.report.seconds,
              graphs=self.report.graphs, loaded=self.report.loaded, cache_hits=self.report.cache_hits,
              cache_misses=self.report.cache_misses, device_seconds=self.report.device_seconds,
              phases=_joined(self.report.phases), classes=_joined(self.report.classes))
        return self.report

    def _compile(self, classes: dict[str, tuple[int, int, bool, bool]], options: dict[str, Any],
                 store: Path | None) -> None:
        """Bind the compiled forward to every layer and run each class once, under the forward lock's caller; with
        a ``store``, each class is loaded whole from there, or compiled ahead of time and saved (precompiled.py)."""
        graphs, (hits, misses), timers, started = _graphs(), _cache_lookups(), _timers(), time.monotonic()
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        backend, config = _backend(options, lambda: self.report.active), _tracing_config()
        compiled = {cls: torch.compile(cls.forward, dynamic=True, **backend)
                    for cls in {type(layer) for layer in self.layers}}
        saved = {} if store is None else {cls: precompiled.ClassFunctions(cls, store, _ahead_of_time(backend, config))
                                          for cls in compiled}
        self._saved = saved
        for layer in self.layers:
            traced = _bound(compiled[type(layer)], layer, config)
            layer.forward = precompiled.LayerForward(saved[type(layer)], layer, traced) if saved else traced
        seconds: dict[str, float] = {}
        with _no_compile_pool(self.report.manifest):
            for name, shape in classes.items():
                begun = time.monotonic()
                for functions in saved.values():
                    functions.warming = None if functions.failed else name
                try:
                    with packing.any_length_attention():  # as served (watch): the graph's attention kernel
                        self._warm_up(*shape)
                finally:
                    for functions in saved.values():
                        functions.warming = None
                        functions.take_miss()  # a warm-up's: not a recompile's reason
                seconds[name] = round(time.monotonic() - begun, 2)
        now_hits, now_misses = _cache_lookups()
        total = round(time.monotonic() - started, 2)
        loaded = sum(all(name in f.loaded for f in saved.values()) for name in classes) if saved else 0
        issue = next((f.issue for f in saved.values() if f.issue), None)
        self.report = dataclasses.replace(self.report, active=True, seconds=total, graphs=_graphs() - graphs,
                                          loaded=loaded, saved_classes_issue=issue, cache_hits=now_hits - hits,
                                          cache_misses=now_misses - misses,
                                          cache_dir=_cache_dir(), classes=seconds,
                                          phases=_phases(timers, total, sum(f.load_seconds for f in saved.values())))

    # -- serving ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def watch(self, shape: Sequence[int]) -> Iterator[None]:
        """Around a forward (under the engine's forward lock): run it with the attention kernels the classes were
        compiled with (``packing.any_length_attention``: no cuDNN, which plans each new length anew), and count
        and log the graphs it compiled.

        Dynamo's counters are process-wide, so a compile by another compiled model in this process at
        the same moment would be counted here too. Where classes are saved, the line says which of their guards
        refused the call (``reason``: e.g. a size outside a class, or dynamo's global state, such as torch's
        math threads, changed since load)."""
        before, started = _graphs(), time.monotonic()
        with packing.any_length_attention():
            yield
        compiled = _graphs() - before
        missed = [m for m in (f.take_miss() for f in self._saved.values()) if m is not None]
        if compiled:
            seconds = time.monotonic() - started
            self.report.recompiles += 1
            self.report.recompile_seconds = round(self.report.recompile_seconds + seconds, 2)
            self.report.recompile_reason = "; ".join(missed) or None
            event(log, logging.INFO, "compile.recompiled", model=self.name, shape=list(shape), graphs=compiled,
                  seconds=round(seconds, 2), recompiles=self.report.recompiles, reason=self.report.recompile_reason)

    def fall_back(self, exc: BaseException) -> None:
        """A compiled forward failed to compile (a recompile): eager from now on, one WARNING."""
        self._fail(one_line(exc))

    # -- undo ------------------------------------------------------------------------------------

    def _fail(self, reason: str) -> None:
        self._undo()
        self.report.active, self.report.reason = False, reason
        event(log, logging.WARNING, "compile.failed", model=self.name, serving="eager", reason=reason)

    def _undo(self) -> None:
        for layer in self.layers:
            layer.__dict__.pop("forward", None)  # the class's own forward again


def _joined(values: dict[str, float]) -> str:
    """``{"a": 1.0, "b": 2.5}`` as ``a:1.0,b:2.5`` (one token in a log line)."""
    return ",".join(f"{k}:{v}" for k, v in values.items())


def cache_dir_from(path: str | Path | None) -> None:
    """Point Inductor's caches at ``path`` (process-wide, as torch reads it; before the first compile)."""
    if path is not None:
        os.environ[CACHE_ENV] = str(Path(path).expanduser().resolve())
