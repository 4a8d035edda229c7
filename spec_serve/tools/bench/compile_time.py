"""Compile time: fresh processes compiling the target cold, warm, and from saved artifacts."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from spec_serve.tools.bench.checks import _figure
from spec_serve.tools.bench.config import LLAMA_8B_AUX_LAYERS

if TYPE_CHECKING:
    from spec_serve.engines.compiled import CompileReport
    from spec_serve.tools.bench.context import Context


def run_compile_time(ctx: Context) -> dict[str, Any]:
    """compile_cold, compile_warm, compile_warm_packing, compile_warm_unsaved and compile_artifacts, each a fresh
    process (``_compile_probe``) on the target, in that order; the figures go into the report at once
    (``Context.extra_figures``). compile_warm is the load of a worker without --packing (no packed class), the
    others a packing worker's (every class; the cold one so fills the cache for both)."""
    cold_dir, fresh_dir = Path(ctx.tmp) / "inductor-cold", Path(ctx.tmp) / "inductor-artifacts"
    artifacts = Path(ctx.tmp) / "compile-artifacts.bin"
    for d in (cold_dir, fresh_dir):
        shutil.rmtree(d, ignore_errors=True)
    artifacts.unlink(missing_ok=True)
    runs = {"compile_cold": (cold_dir, "save", True), "compile_warm": (cold_dir, "", False),
            "compile_warm_packing": (cold_dir, "", True), "compile_warm_unsaved": (cold_dir, "forget", True),
            "compile_artifacts": (fresh_dir, "load", True)}
    figures = {name: _compile_probe(ctx, name, cache, mode, artifacts, packed)
               for name, (cache, mode, packed) in runs.items()}
    ctx.extra_figures.update({k: v for k, v in figures.items() if k != "compile_cold"})
    return figures["compile_cold"]


# The compile-time targets at the Llama-3.1-8B shape on one H200 (issue 26).
COMPILE_TARGET_S = {"compile_cold": 30.0, "compile_warm": 5.0, "compile_warm_packing": 5.0}


def _compile_probe(ctx: Context, name: str, cache: Path, mode: str, artifacts: Path, packed: bool) -> dict[str, Any]:
    aux = LLAMA_8B_AUX_LAYERS if ctx.cfg.gpu_8b else ""
    args = [ctx.target, str(ctx.device), ctx.cfg.dtype or "", aux, str(cache), mode, str(artifacts),
            "packed" if packed else ""]
    proc = subprocess.run([sys.executable, "-m", "spec_serve.tools.bench", "_compile_probe", *args],
                          capture_output=True, text=True, env=os.environ.copy(), timeout=1800)
    if proc.returncode != 0:
        tail = " ".join(proc.stderr.strip().splitlines()[-3:])
        return _figure(name, 0, 0, 0.0, status="INVALID", error=tail[-500:])
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    seconds = round(report["seconds"] + report["artifacts_seconds"], 2)
    return _figure(name, 0, 0, seconds, load_seconds=report["load_seconds"], graphs=report["graphs"],
                   cache_hits=report["cache_hits"], cache_misses=report["cache_misses"],
                   compiled=report["active"], h200_target_s=COMPILE_TARGET_S.get(name),
                   artifacts_seconds=report["artifacts_seconds"], device_seconds=report["device_seconds"],
                   phases=report["phases"], classes=report["classes"], manifest=report["manifest"],
                   loaded=report["loaded"], saved_classes_off=report["saved_classes_off"],
                   saved_classes_issue=report["saved_classes_issue"],
                   **({} if report["active"] else {"status": "INVALID", "error": report["reason"]}))


def _compile_probe_main(args: list[str]) -> None:
    """A fresh process: build ``HFTarget(compile=True)`` on an Inductor cache dir and print its compile report as
    JSON. ``save``: then write the cache artifacts; ``load``: first load them (timed: ``artifacts_seconds``);
    ``forget``: first delete the manifests and saved classes loads left in the cache (Inductor's kernels stay).
    ``packed`` empty: the engine of a worker without --packing (``compile_packed=False``)."""
    from spec_serve.engines import compiled
    from spec_serve.engines.hf import HFTarget

    target, device, dtype, aux, cache, mode, artifacts, packed = args
    started = time.perf_counter()
    if mode == "load":
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        torch.compiler.load_cache_artifacts(Path(artifacts).read_bytes())
    artifacts_seconds = time.perf_counter() - started
    if mode == "forget":
        shutil.rmtree(Path(cache) / compiled.MANIFEST_DIR, ignore_errors=True)
    started = time.perf_counter()
    engine = HFTarget(target, device=device, dtype=dtype or None, compile=True, compile_cache=cache,
                      compile_packed=bool(packed), aux_layer_ids=[int(i) for i in aux.split(",")] if aux else None)
    load_seconds = time.perf_counter() - started
    if mode == "save":
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            Path(artifacts).write_bytes(saved[0])
    report = dataclasses.asdict(cast("CompileReport", engine.compile_report))
    print(json.dumps({**report, "load_seconds": round(load_seconds, 2),
                      "artifacts_seconds": round(artifacts_seconds, 2)}), flush=True)
