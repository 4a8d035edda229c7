"""Issue 40 item 4: a fresh ``--compile`` worker on row lengths it has never seen, in one process (one device call).

    python benchmarks/compile_new_lengths.py --gpu-8b --json OUT.json     # one H100, about 3-4 minutes
    python benchmarks/compile_new_lengths.py --device cpu --seq 128        # a dry run on the tiny target

What it measures, every figure side by side in this run (the batches: ``--batches`` log-normal batches of ``--rows``
rows, median 0.29 x ``--seq`` tokens, each right-padded to its longest row, as ``spec-serve bench --lengths
lognormal`` draws them; every padded length new to every engine):

1. The colocated eager forward over the batches twice (``eager_first``: lengths it meets for the first time;
   ``eager``: the same batches again), timed batch by batch, synchronised.
2. The colocated ``HFTarget(compile=True)`` (as a worker without --packing compiles: no packed class), compiled cold
   into an empty cache (its compile seconds reported apart), then over the batches twice; its answers are kept.
   Beside it, compiled against eager on full rows (``full_rows``: one length, where cuDNN's attention, which eager
   keeps and the compiled layers leave out, plans once).
3. A fresh worker started with ``--compile`` on that cache (it loads the saved classes; its compile seconds come
   from its ``compile.done`` line), through the same-host plane, prefetch 2: its first pass over the batches
   (``worker_first``: every length new to it, timed from the first request to the last answer), then a second pass
   (``worker_seen``). Every answer of the first pass is compared bit for bit with the colocated compiled engine's
   (``bit_equal``), and the worker's ``/metrics`` are read after each pass: ``spec_serve_worker_compile_recompiles
   _total`` must stay 0 after load, its log must hold no ``compile.recompiled`` line (whose ``reason`` would name
   the guard that refused).
4. A worker of a second target of the same configuration (other weights, its own directory) on the same cache:
   how many batch classes it loaded whole, and any ``compile.saved_class_unusable`` line.
5. (Time permitting) a fresh eager worker over the same batches: whether what a fresh worker pays for new lengths
   is the compiled layers' or any fresh process's.

Ratios are useful tokens/s against the colocated eager forward's second pass (the stricter baseline: it has seen
the lengths); the target is ``worker_first / eager >= 1.15``. The process runs with one math thread, as the
workers (``launch`` starts them with OMP_NUM_THREADS=1): saved classes are keyed by torch's thread count
(docs/compile.md). Writes JSON (``--json``) and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

TARGET_RATIO = 1.15


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _colocated_pass(engine, batches, device, keep: bool = False) -> tuple[list[float], list[dict]]:
    """Seconds of each batch's forward (synchronised), and the answers if ``keep``."""
    seconds, outputs = [], []
    for batch in batches:
        _sync(device)
        started = time.perf_counter()
        out = engine.generate_batch(*batch, kind="eagle3")
        _sync(device)
        seconds.append(time.perf_counter() - started)
        if keep:
            outputs.append(out)
    return seconds, outputs


def _remote_pass(client, batches, device) -> tuple[float, list[float], list[dict]]:
    """Seconds from the first request to the last answer (prefetch keeps the pipeline full), each batch's
    completion time since the first request, and the answers."""
    done: dict[int, float] = {}
    _sync(device)
    started = time.perf_counter()
    futures = []
    for i, batch in enumerate(batches):
        future = client.generate_batch_async(*batch, kind="eagle3")
        future.add_done_callback(lambda _, i=i: done.setdefault(i, time.perf_counter()))
        futures.append(future)
    outputs = []
    for i, future in enumerate(futures):
        outputs.append(future.result())
        done.setdefault(i, time.perf_counter())
    _sync(device)
    finished = time.perf_counter()
    return finished - started, [round(done[i] - started, 4) for i in range(len(batches))], outputs


def _metrics(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    # The compile counters, and the worker's own forward seconds (sum, count): the forward apart from transport.
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if not s.labels and (s.name.startswith("spec_serve_worker_compile")
                                 or s.name in ("spec_serve_worker_forward_seconds_sum",
                                               "spec_serve_worker_forward_seconds_count"))}


def _log_facts(log: str) -> dict:
    done = [line for line in log.splitlines() if " compile.done " in line]
    seconds = re.search(r" seconds=([0-9.]+)", done[-1]) if done else None
    loaded = re.search(r" loaded=([0-9]+)", done[-1]) if done else None
    return {"compile_seconds": float(seconds.group(1)) if seconds else None,
            "loaded": int(loaded.group(1)) if loaded else None,
            "recompiled_lines": [line for line in log.splitlines() if " compile.recompiled " in line],
            "unusable_lines": [line for line in log.splitlines() if " compile.saved_class_unusable " in line],
            "compile_done": done[-1] if done else None}


def _rate(tokens: int, seconds: float) -> float:
    return round(tokens / seconds, 1) if seconds else 0.0


def _worker(target, args, worker_args, log_dir, batches, mapping, device, compiled_outputs=None):
    """One fresh worker of ``target``: two passes over ``batches``; its figures."""
    from spec_serve.client.api import RemoteTargetModel
    from spec_serve.tools.launch import free_port, local_cluster
    from spec_serve.tools.verify import mismatch

    port = free_port()
    common = ["--device", args.device, "--http-port", str(port)] + (["--dtype", args.dtype] if args.dtype else [])
    figure: dict = {}
    with local_cluster(target, workers=1, worker_args=[*common, *worker_args], log_dir=log_dir,
                       ready_timeout=args.ready_timeout) as cluster:
        with RemoteTargetModel(cluster.frontend, device=device, prefetch_depth=2, timeout=600,
                               same_host_plane=True) as client:
            client.set_vocab_mapping(*mapping)
            figure["forwards_before"] = _metrics(port).get("spec_serve_worker_forward_seconds_sum", 0.0)
            for name in ("first", "seen"):
                seconds, done, outputs = _remote_pass(client, batches, device)
                figure[name] = {"seconds": round(seconds, 4), "done_at": done}
                figure[f"metrics_after_{name}"] = _metrics(port)
                if name == "first" and compiled_outputs is not None:
                    equal = sum(mismatch(out, want) is None for out, want in zip(outputs, compiled_outputs))
                    figure["bit_equal"] = f"{equal}/{len(outputs)}"
                del outputs
            figure["plane_replies"] = client.stats.plane_replies
        log = cluster.log_path("worker0").read_text()
    figure.update(_log_facts(log))
    return figure


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu-8b", action="store_true", help="the Llama-3.1-8B shape, random bf16 weights")
    parser.add_argument("--target", help="a model directory (default: the tiny target, or the 8B shape)")
    parser.add_argument("--device", default=None, help="default cuda:0 with --gpu-8b, else cpu")
    parser.add_argument("--dtype", default=None, help="default bfloat16 with --gpu-8b")
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--budget", type=float, default=400.0, help="seconds; the eager-worker control is skipped "
                        "past two thirds of it")
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--log-dir", help="worker logs (default: a temporary directory)")
    args = parser.parse_args(argv)
    args.device = args.device or ("cuda:0" if args.gpu_8b else "cpu")
    args.dtype = args.dtype or ("bfloat16" if args.gpu_8b else None)
    return args


def _targets(args: argparse.Namespace, tmp: Path) -> tuple[Path, Path | None]:
    """The target, and a second one of its configuration with other weights (None for ``--target``)."""
    from spec_serve.tools.bench import LLAMA_8B_CONFIG
    from spec_serve.tools.random_target import write_random_init_target
    from spec_serve.tools.tiny import make_tiny_target

    if args.target:
        return Path(args.target), None
    if args.gpu_8b:
        return (write_random_init_target(tmp / "llama-8b-shape", LLAMA_8B_CONFIG),
                write_random_init_target(tmp / "llama-8b-shape-other-weights", LLAMA_8B_CONFIG, seed=1))
    return make_tiny_target(tmp / "tiny"), make_tiny_target(tmp / "tiny-other-weights", seed=7)


def _full_rows(eager, compiled, args, vocab: int, device) -> dict:
    """Colocated compiled against eager on full rows (``--rows`` x ``--seq``, one length: no plan to build twice),
    alternating, 4 timed batches each after one: what the compiled layers' attention kernels cost where cuDNN's
    would be planned once (issue 26 measured 1.195x with them)."""
    from spec_serve.tools.bench import make_batch

    batches = [make_batch(args.rows, args.seq, vocab, seed=2000 + i) for i in range(5)]
    seconds = {"eager": 0.0, "compiled": 0.0}
    for i, batch in enumerate(batches):
        for name, engine in (("eager", eager), ("compiled", compiled)):
            spent, _ = _colocated_pass(engine, [batch], device)
            seconds[name] += spent[0] if i else 0.0
    return {**{k: round(v, 4) for k, v in seconds.items()},
            "compiled / eager": round(seconds["eager"] / seconds["compiled"], 3) if seconds["compiled"] else None}


def _colocated(report: dict, target: Path, args, aux, batches, mapping, device) -> list[dict]:
    """Steps 1 and 2 (the module doc) into ``report``; returns the colocated compiled engine's answers."""
    from spec_serve.engines.hf import HFTarget

    eager = HFTarget(target, device=device, dtype=args.dtype, aux_layer_ids=aux)
    eager.set_vocab_mapping(*mapping)
    # One forward of a length not among the batches first, as a worker's load-time probe: the device's and the
    # libraries' start-up (cuBLAS handles) is not a cost of new lengths.
    _colocated_pass(eager, [tuple(t[:1, :64] for t in batches[0])], device)
    for name in ("eager_first", "eager"):
        seconds, _ = _colocated_pass(eager, batches, device)
        report[name] = {"seconds": round(sum(seconds), 4), "per_batch": [round(s, 4) for s in seconds]}
    compiled = HFTarget(target, device=device, dtype=args.dtype, aux_layer_ids=aux, compile=True,
                        compile_packed=False)
    compiled.set_vocab_mapping(*mapping)
    report["full_rows"] = _full_rows(eager, compiled, args, eager.vocab_size, device)
    del eager
    report["colocated_compile"] = {k: getattr(compiled.compile_report, k) for k in
                                   ("active", "reason", "seconds", "graphs", "loaded", "classes", "phases")}
    recompiles = compiled.compile_report.recompiles
    first, outputs = _colocated_pass(compiled, batches, device, keep=True)
    again, _ = _colocated_pass(compiled, batches, device)
    report["colocated_compiled_first"] = {"seconds": round(sum(first), 4), "per_batch": [round(s, 4) for s in first]}
    report["colocated_compiled"] = {"seconds": round(sum(again), 4)}
    report["colocated_compiled_recompiles_after_load"] = compiled.compile_report.recompiles - recompiles
    report["colocated_compiled_recompile_reason"] = compiled.compile_report.recompile_reason
    del compiled  # the workers' turn: their own copies of the weights
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return outputs


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    began = time.monotonic()
    from spec_serve.supervision.vocab import build_vocab_mapping
    from spec_serve.tools.bench import LLAMA_8B_AUX_LAYERS, padded_batch, row_lengths

    torch.set_num_threads(1)  # as the workers run (launch: OMP_NUM_THREADS=1): one key for the saved classes
    device = torch.device(args.device)
    tmp = Path(tempfile.mkdtemp(prefix="compile-new-lengths-"))
    log_dir = Path(args.log_dir) if args.log_dir else tmp / "logs"
    # Empty: the colocated compiled engine compiles cold and saves the classes; the workers inherit it.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp / "inductor-cache")
    target, second = _targets(args, tmp)
    aux = [int(i) for i in LLAMA_8B_AUX_LAYERS.split(",")] if args.gpu_8b else None
    aux_args = ["--aux-layer-ids", LLAMA_8B_AUX_LAYERS] if args.gpu_8b else []
    vocab = int(json.loads((target / "config.json").read_text())["vocab_size"])
    batches = [padded_batch(rows, vocab, seed=1000 + i)
               for i, rows in enumerate(row_lengths("lognormal", args.batches, args.rows, args.seq))]
    tokens = sum(int(b[1].sum()) for b in batches)
    ids, loss = torch.cat([b[0].reshape(-1) for b in batches]), torch.cat([b[2].reshape(-1) for b in batches])
    mapping = build_vocab_mapping(ids, loss, vocab, min(256, vocab))  # the bench's draft vocabulary
    report: dict = {"when": time.strftime("%Y-%m-%d %H:%M:%S %z"), "device": str(device),
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "batches": args.batches, "rows": args.rows, "seq": args.seq,
                    "padded_lengths": [int(b[0].shape[1]) for b in batches], "useful_tokens": tokens}
    compiled_outputs = _colocated(report, target, args, aux, batches, mapping, device)
    _attempt(report, "worker", _worker, target, args, ["--compile", *aux_args], log_dir / "compiled", batches,
             mapping, device, compiled_outputs)
    del compiled_outputs
    if second is not None:
        _attempt(report, "second_target_worker", _second_target, second, args, aux_args, log_dir / "second",
                 batches[:2], mapping, device)
    if time.monotonic() - began < args.budget * 2 / 3:
        _attempt(report, "eager_worker", _worker, target, args, aux_args, log_dir / "eager", batches, mapping, device)
    report["ratios"] = _ratios(report, tokens)
    report["seconds"] = round(time.monotonic() - began, 1)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(summary(report))
    return 0 if _met(report) else 1


def _attempt(report: dict, name: str, run, *args) -> None:
    """``report[name] = run(*args)``; a worker that does not start or answer leaves ``{"error": ...}`` there
    instead, and the other figures are still reported."""
    try:
        report[name] = run(*args)
    except Exception as e:
        report[name] = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"}


def _second_target(target, args, aux_args, log_dir, batches, mapping, device) -> dict:
    """A worker of another target of the same configuration on the same cache: what it loaded."""
    figure = _worker(target, args, ["--compile", *aux_args], log_dir, batches, mapping, device)
    return {k: figure[k] for k in ("compile_seconds", "loaded", "unusable_lines", "compile_done", "recompiled_lines")}


def _ratios(report: dict, tokens: int) -> dict[str, float | None]:
    eager = _rate(tokens, report["eager"]["seconds"])

    def over_eager(seconds: float | None) -> float | None:
        return round(_rate(tokens, seconds) / eager, 3) if seconds and eager else None

    def passed(name: str, run: str) -> float | None:
        return report.get(name, {}).get(run, {}).get("seconds")

    worker_first = passed("worker", "first")
    return {"worker_first / eager": over_eager(worker_first),
            "worker_first / eager_first": round(report["eager_first"]["seconds"] / worker_first, 3)
            if worker_first else None,
            "worker_seen / eager": over_eager(passed("worker", "seen")),
            "colocated_compiled_first / eager": over_eager(report["colocated_compiled_first"]["seconds"]),
            "colocated_compiled / eager": over_eager(report["colocated_compiled"]["seconds"]),
            "eager_worker_first / eager": over_eager(passed("eager_worker", "first")),
            "eager_worker_seen / eager": over_eager(passed("eager_worker", "seen"))}


def _forward_seconds(figure: dict) -> tuple[float | None, float | None]:
    """The worker's forward seconds in its first and its second pass (its /metrics histogram's sums; the load-time
    probe's forward is in neither)."""
    first, seen = (figure[f"metrics_after_{p}"].get("spec_serve_worker_forward_seconds_sum") for p in ("first", "seen"))
    if first is None or seen is None:
        return None, None
    return round(first - figure["forwards_before"], 4), round(seen - first, 4)


def _met(report: dict) -> bool:
    worker = report["worker"]
    if "error" in worker:
        return False
    return (worker.get("bit_equal", "").split("/")[0] == str(report["batches"])
            and worker["metrics_after_seen"].get("spec_serve_worker_compile_recompiles_total", 1) == 0
            and not worker["recompiled_lines"])


def _worker_lines(name: str, worker: dict, report: dict) -> list[str]:
    if "error" in worker:
        return [f"  {name}: FAILED: {worker['error']}"]
    recompiles = [worker[f"metrics_after_{p}"].get("spec_serve_worker_compile_recompiles_total") for p in
                  ("first", "seen")]
    first, seen = _forward_seconds(worker)
    lines = [f"  {name}: its forwards' own seconds (/metrics): first pass {first}, second pass {seen} (colocated "
             f"eager: {report['eager']['seconds']}); answers of the first pass done at (s since the first request): "
             f"{worker['first']['done_at']}"]
    if worker["compile_seconds"] is not None:
        lines.append(f"    compile {worker['compile_seconds']} s at load (excluded), classes loaded whole "
                     f"{worker['loaded']}; bit-equal to colocated HFTarget(compile=True): {worker.get('bit_equal')}; "
                     f"recompiles after load (metric): {recompiles[0]} after the first pass, {recompiles[1]} after "
                     f"the second; compile.recompiled lines: {len(worker['recompiled_lines'])}")
    return lines + [f"    {line}" for line in worker["recompiled_lines"][:5]]


def _second_lines(second: dict) -> list[str]:
    if "error" in second:
        return [f"  second target: FAILED: {second['error']}"]
    return [f"  second target (same config, other weights): loaded {second['loaded']} classes whole, compile "
            f"{second['compile_seconds']} s, saved_class_unusable lines: {len(second['unusable_lines'])}"] + \
        [f"    {line}" for line in second["unusable_lines"][:4]]


def summary(report: dict) -> str:
    ratios = report["ratios"]
    value = ratios["worker_first / eager"]
    verdict = "-" if value is None else "MET" if value >= TARGET_RATIO else "NOT MET"
    lines = [f"compile_new_lengths ({report['when']}, {report['gpu']}, torch {report['torch']}): "
             f"{report['batches']} log-normal batches of {report['rows']} rows, padded lengths "
             f"{report['padded_lengths']}, {report['useful_tokens']} useful tokens",
             f"  fresh --compile worker, first {report['batches']} batches / colocated eager: {value} "
             f"(target >= {TARGET_RATIO}) {verdict}"]
    lines += [f"  {name}: {v}" for name, v in ratios.items() if name != "worker_first / eager"]
    for name in ("worker", "eager_worker"):
        if name in report:
            lines += _worker_lines(name, report[name], report)
    lines.append(f"  full rows ({report['rows']} x {report['seq']}), colocated compiled / eager: "
                 f"{report['full_rows']['compiled / eager']} (issue 26, with cuDNN attention: 1.195 on an H200)")
    lines.append(f"  colocated compiled: compile {report['colocated_compile']['seconds']} s cold (excluded), "
                 f"recompiles after load {report['colocated_compiled_recompiles_after_load']} "
                 f"({report['colocated_compiled_recompile_reason']})")
    if "second_target_worker" in report:
        lines += _second_lines(report["second_target_worker"])
    lines.append(f"  per-batch seconds, eager (seen): {report['eager']['per_batch']}")
    lines.append(f"  per-batch seconds, eager (first): {report['eager_first']['per_batch']}")
    lines.append(f"  per-batch seconds, colocated compiled (first): {report['colocated_compiled_first']['per_batch']}")
    lines.append(f"  verdict: {'ok' if _met(report) else 'FAILED (a worker, bit-equality or recompiles)'}; "
                 f"{report['seconds']} s in all")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
