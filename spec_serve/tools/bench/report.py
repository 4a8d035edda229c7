"""A run: the scenarios in alternating rounds, the ratios within each round, and the table."""

from __future__ import annotations

import dataclasses
import os
import platform
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from spec_serve.tools.bench.config import BenchConfig, bytes_per_token
from spec_serve.tools.bench.context import Context
from spec_serve.tools.bench.scenarios import SCENARIOS

# (label, numerator, denominator, target on an H200 or None); ratios of tokens/s (or GB/s).
RATIOS = [
    ("packed / padded forward, colocated (useful tokens/s)", "colocated_packed", "colocated", 1.5),
    ("remote packing worker, compact / colocated padded (useful tokens/s)", "remote_1w_compact_packed", "colocated",
     1.5),
    # Full EAGLE-3 replies keep their padded layout (the contract), so over frames they stay bytes-bound.
    ("remote packing worker, full / colocated padded (useful tokens/s)", "remote_1w_packed", "colocated", None),
    ("same-host plane packing worker, full / colocated padded (useful tokens/s)", "samehost_1w_packed", "colocated",
     1.5),
    ("same-host plane packing worker, compact / colocated padded (useful tokens/s)", "samehost_1w_compact_packed",
     "colocated", 1.5),
    ("same-host plane packing worker, client on its own GPU / colocated padded (useful tokens/s)",
     "samehost_1w_packed_own_gpu", "colocated", 1.5),
    ("remote packing worker compact, client on its own GPU / colocated padded (useful tokens/s)",
     "remote_1w_compact_packed_own_gpu", "colocated", 1.5),
    ("compiled / eager forward, colocated", "colocated_compiled", "colocated", None),
    ("same-host plane compiled worker / colocated eager", "samehost_1w_compiled", "colocated", 1.15),
    ("same-host plane compiled worker / colocated compiled", "samehost_1w_compiled", "colocated_compiled", 0.95),
    ("compiled packed / padded eager forward, colocated (useful tokens/s)", "colocated_packed_compiled", "colocated",
     None),
    ("same-host plane compiled packing worker / colocated padded eager (useful tokens/s)",
     "samehost_1w_packed_compiled", "colocated", 2.0),
    ("same-host plane compiled / eager packing worker (useful tokens/s)", "samehost_1w_packed_compiled",
     "samehost_1w_packed", None),
    ("remote 1 worker / colocated", "remote_1w", "colocated", 0.95),
    ("remote 1 worker compact / colocated compact", "remote_1w_compact", "colocated_compact", 0.95),
    # Issue 25: full EAGLE-3 with the defaults, from another host (the plane off), against the colocated forward.
    ("remote 1 worker, defaults (compact=auto) / colocated", "remote_1w_auto", "colocated", 0.95),
    # Issue 40: the same across hosts with compact=True, against the forward a trainer would otherwise run.
    ("remote 1 worker compact / colocated", "remote_1w_compact", "colocated", 0.97),
    ("remote 1 worker, client on its own GPU / colocated", "remote_1w_own_gpu", "colocated", 0.95),
    ("remote 1 worker compact, client on its own GPU / colocated compact", "remote_1w_compact_own_gpu",
     "colocated_compact", 0.95),
    ("compact / full, remote 1 worker", "remote_1w_compact", "remote_1w", None),
    ("remote 1 worker DSpark / colocated DSpark", "remote_1w_dspark", "colocated_dspark", 0.95),
    ("same-host plane 1 worker / colocated", "samehost_1w", "colocated", 0.98),
    ("same-host plane 1 worker compact / colocated compact", "samehost_1w_compact", "colocated_compact", 0.95),
    ("same-host plane 1 worker DSpark / colocated DSpark", "samehost_1w_dspark", "colocated_dspark", 0.95),
    ("same-host plane, client on its own GPU / colocated", "samehost_1w_own_gpu", "colocated", 0.95),
    ("same-host plane / frames, 1 worker", "samehost_1w", "remote_1w", None),
    ("same-host plane 2 workers / 1 worker", "samehost_2w", "samehost_1w", 1.9),
    ("same-host plane 2 workers / 1 worker, compact", "samehost_2w_compact", "samehost_1w_compact", 1.9),
    ("remote NCCL / colocated", "remote_nccl", "colocated", 0.95),
    ("remote NCCL / remote frames, 1 worker", "remote_nccl", "remote_1w", None),
    ("remote NCCL compact / colocated compact", "remote_nccl_compact", "colocated_compact", 0.95),
    ("2 workers / 1 worker", "remote_2w", "remote_1w", 1.9),
    ("2 workers / 1 worker, compact", "remote_2w_compact", "remote_1w_compact", 1.9),
    ("small requests: batched / unbatched", "small_batched", "small_unbatched", None),
    ("broker path / direct socket (same bytes)", "broker_null", "direct_null", None),
    ("same-host plane / frames through the broker, transport only (same bytes)", "samehost_null", "broker_null",
     None),
    ("compact / full replies through the broker, transport only (tokens/s)", "broker_null_compact", "broker_null",
     None),
    ("frames / raw ZeroMQ (same bytes)", "frames", "zmq_raw", 0.9),
    ("frames / raw ZeroMQ, ipc (same bytes)", "frames_ipc", "zmq_raw_ipc", 0.9),
    ("raw ZeroMQ: ipc / tcp loopback", "zmq_raw_ipc", "zmq_raw", None),
    ("frames: recycled / fresh receive buffers", "frames", "frames_fresh", None),
]


def run(cfg: BenchConfig, progress: Callable[[str], None] = lambda name: None) -> dict[str, Any]:
    """Run the chosen scenarios ``cfg.repeat`` times; return the JSON-ready report.

    Rounds alternate the scenario order (forward, backward, ...) so slow drift of a shared machine
    (clocks, other jobs) does not favour the scenarios that run first. Each ratio is computed within
    a round, from figures measured minutes apart at most, and reported as the median over rounds with
    its range; each figure is the round with the median rate.
    """
    names = [n for n in SCENARIOS if not cfg.only or n in cfg.only]
    unknown = set(cfg.only) - set(SCENARIOS)
    if unknown:
        raise ValueError(f"unknown scenarios {sorted(unknown)}; choose from {sorted(SCENARIOS)}")
    if cfg.repeat < 1:
        raise ValueError("repeat must be >= 1")
    with tempfile.TemporaryDirectory(prefix="spec-serve-bench-") as tmp:
        ctx = Context(cfg, tmp)
        try:
            services = set().union(*(SCENARIOS[n][0] for n in names)) if names else set()
            if services:
                progress("start cluster")
                ctx.start_cluster(services)
            rounds: list[dict[str, dict]] = []
            for r in range(cfg.repeat):
                figures = {}
                for name in names if r % 2 == 0 else names[::-1]:
                    progress(name if cfg.repeat == 1 else f"{name} ({r + 1}/{cfg.repeat})")
                    figures[name] = SCENARIOS[name][1](ctx)
                    figures.update(ctx.extra_figures)
                    ctx.extra_figures.clear()
                rounds.append(figures)
        finally:
            ctx.close()
        figures = {name: _median_figure([rd[name] for rd in rounds]) for name in rounds[0]} if rounds else {}
        ratios = [_ratio(label, a, b, goal, figures, rounds) for label, a, b, goal in RATIOS
                  if a in figures and b in figures]
        report = {
            "when": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                        "torch": torch.__version__,
                        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
            "config": dataclasses.asdict(cfg),
            "target": {"path": ctx.target, **ctx.info, "layers": ctx.config["num_hidden_layers"],
                       "dtype_bytes": ctx.dtype_bytes},
            "bytes_per_token": {
                "this_target": ctx.reply_bytes_per_token,
                "llama_8b_shape_vd32000_bf16": bytes_per_token(4096, 32000, 2),
                "measured": {n: round(f["bytes"] / f["tokens"], 1) for n, f in figures.items()
                             if f["tokens"] and n.startswith(("colocated", "remote", "samehost"))},
            },
            "figures": figures,
            "ratios": ratios,
        }
    return report


# A remote scenario runs the very forward the colocated one times, plus transport: faster than that by
# more than noise means the figure measures something else (wrong or missing work, a slowed colocated run).
IMPLAUSIBLE_OVER_COLOCATED = 1.10


def _ratio(label: str, a: str, b: str, goal, figures: dict, rounds: list[dict]) -> dict[str, Any]:
    """One ratio row: the median over rounds; status "invalid" (and no value) if either side had a wrong
    batch in any round, "implausible" for a remote padded scenario over 1.10x its colocated one."""
    key = _rate_key(figures[a], figures[b])
    values = sorted(rd[a][key] / rd[b][key] for rd in rounds if rd[a][key] and rd[b][key])
    ratio = {"ratio": label, "of": key, "value": round(_median(values), 3) if values else None,
             "h200_target": goal, "status": "ok"}
    if len(values) > 1:
        ratio["rounds"] = [round(v, 3) for v in values]
    if any(rd[n].get("status") == "INVALID" for rd in rounds for n in (a, b)):
        ratio.update(status="invalid", value=None)
    elif a.startswith(("remote", "samehost")) and b.startswith("colocated") and _forward(a) == _forward(b) \
            and (ratio["value"] or 0) > IMPLAUSIBLE_OVER_COLOCATED:
        ratio["status"] = "implausible"
    return ratio


def _forward(scenario: str) -> tuple[bool, bool]:
    """Which forward a scenario runs: (packed, compiled). Packing skips padding and compiled layers fuse
    kernels, so either may beat a colocated forward of the other kind; never one of its own kind."""
    return "_packed" in scenario, "_compiled" in scenario


def _rate_key(a: dict[str, Any], b: dict[str, Any]) -> str:
    return "tokens_per_s" if a["tokens"] and b["tokens"] else "gb_per_s"


def _median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _median_figure(figures: list[dict[str, Any]]) -> dict[str, Any]:
    """The figure of the median round (by rate), with every round's rate listed when there are several."""
    if len(figures) == 1:
        return figures[0]
    key = _rate_key(figures[0], figures[0])
    ranked = sorted(figures, key=lambda f: f[key] or 0)
    median = dict(ranked[(len(ranked) - 1) // 2], rounds=[f[key] for f in figures])
    if "verified" in median:  # every round's batches count, not the median round's alone
        passed, total = _count_over_rounds(figures, "verified")
        median["verified"] = f"{passed}/{total}"
        median.pop("status", None)
        if passed != total:
            median["status"] = "INVALID"
    if "bit_equal_compiled" in median:
        median["bit_equal_compiled"] = "{}/{}".format(*_count_over_rounds(figures, "bit_equal_compiled"))
    for key in ("worst", "noise"):  # the worst of every round
        if key in median:
            median[key] = {k: max(f[key].get(k, 0.0) for f in figures) for k in median[key]}
    if "flip_bound" in median:  # the lowest of every round
        median["flip_bound"] = {k: min(f["flip_bound"].get(k, v) for f in figures)
                                for k, v in median["flip_bound"].items()}
    return median


def _count_over_rounds(figures: list[dict[str, Any]], key: str) -> tuple[int, int]:
    """An "N/M" count summed over every round's figure."""
    passed = sum(int(f[key].split("/")[0]) for f in figures)
    return passed, sum(int(f[key].split("/")[1]) for f in figures)


def format_table(report: dict[str, Any]) -> str:
    shown = ("scenario", "tokens", "bytes", "seconds", "tokens_per_s", "gb_per_s", "padded_tokens",
             "padded_tokens_per_s", "tolerance", "worst", "noise", "phases", "classes", "flip_bound")
    lines = [f"{'scenario':<26}{'useful tok/s':>14}{'padded tok/s':>14}{'GB/s':>9}{'seconds':>9}  notes"]
    for name, f in report["figures"].items():
        notes = ", ".join(f"{k}={v}" for k, v in f.items() if k not in shown)
        tps = f"{f['tokens_per_s']:,.0f}" if f["tokens"] and f["tokens_per_s"] else "-"
        padded = f"{f['padded_tokens_per_s']:,.0f}" if f.get("padded_tokens_per_s") else "-"
        lines.append(f"{name:<26}{tps:>14}{padded:>14}{f['gb_per_s'] or 0:>9.3f}{f['seconds']:>9.3f}  {notes}")
    for name, f in report["figures"].items():
        if "worst" in f:
            lines.append(f"  {name} vs colocated padded, worst over batches (bound: {f['tolerance']}; flip bound, "
                         f"lowest over batches: {f.get('flip_bound')}): "
                         + ", ".join(f"{k}={v}" for k, v in f["worst"].items()))
        if "noise" in f:
            lines.append(f"  {name}: the eager forward's own noise on the same rows (alone vs in their batch): "
                         + ", ".join(f"{k}={v}" for k, v in f["noise"].items()))
        if "phases" in f:
            lines.append(f"  {name}: seconds by phase " + ", ".join(f"{k}={v}" for k, v in f["phases"].items())
                         + "; by batch class " + ", ".join(f"{k}={v}" for k, v in f["classes"].items()))
        equal = f.get("bit_equal_compiled", "")
        if equal and equal.split("/")[0] != equal.split("/")[1]:
            lines.append(f"  {name}: NOT bit-equal to the colocated compiled forward ({equal} batches equal)")
    lines.append("")
    lines.append(f"{'ratio':<48}{'value':>8}{'H200 target':>13}  rounds")
    for r in report["ratios"]:
        goal = f">= {r['h200_target']}" if r["h200_target"] else "-"
        spread = " ".join(map(str, r.get("rounds", ())))
        value = "INVALID" if r["status"] == "invalid" else (r["value"] if r["value"] is not None else "-")
        flag = {"invalid": "  (a batch was wrong: see verified= above)",
                "implausible": f"  IMPLAUSIBLE: remote above {IMPLAUSIBLE_OVER_COLOCATED}x its colocated forward"
                }.get(r["status"], "")
        lines.append(f"{r['ratio']:<48}{value:>8}{goal:>13}  {spread}{flag}")
    bpt = report["bytes_per_token"]
    full, comp = bpt["llama_8b_shape_vd32000_bf16"]["eagle3"], bpt["llama_8b_shape_vd32000_bf16"]["eagle3_compact"]
    lines.append("")
    lines.append(f"reply bytes/token at the Llama-3.1-8B shape (Vd=32000, bf16): EAGLE-3 {full / 1024:.1f} KiB, "
                 f"compact {comp / 1024:.1f} KiB ({full / comp:.1f}x fewer)")
    here = bpt["this_target"]
    lines.append(f"reply bytes/token on this target: EAGLE-3 {here['eagle3']} B, compact {here['eagle3_compact']} B; "
                 f"measured (client-side tensors): {bpt['measured']}")
    return "\n".join(lines)
