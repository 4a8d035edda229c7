"""What benchmarks/gpu_compile.sh measured, on one screen: ``python benchmarks/compile_summary.py OUT_DIR``.

For each bench report in OUT_DIR (bench_full.json, bench_packed.json, compile_time.json): every ratio
with its rounds and target, each compiled figure's verification (within the tolerance of eager, bit-equal
to the colocated compiled forward) with its worst deviation beside the eager forward's own
batch-composition noise on the same rows and its derived flip bound, and the compile times against their
targets with where their seconds went (dynamo's phases, each batch class); new_lengths.json's summary
(benchmarks/compile_new_lengths.py); then the GPU tests' last line and each step's exit status.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# The measures the tolerance discussion turns on (docs/compile.md).
KEY_MEASURES = ("aux_hidden_states.rel_norm", "aux_hidden_states.max_error", "target_probs.rel_norm",
                "position_mask.flip_rate")


def ratios(report: dict) -> list[str]:
    lines = []
    for r in report.get("ratios", []):
        goal = f">= {r['h200_target']}" if r.get("h200_target") else "-"
        met = "" if not r.get("h200_target") or r["value"] is None else \
            ("  MET" if r["value"] >= r["h200_target"] else "  NOT MET")
        lines.append(f"  {r['ratio']}: {r['value']} (target {goal}, rounds {r.get('rounds', '-')}, "
                     f"{r['status']}){met}")
    return lines


def compile_figure(name: str, f: dict) -> list[str]:
    """A compile-time figure against its target, then where its seconds went."""
    target = f.get("h200_target_s")
    verdict = "" if target is None else ("  MET" if f["seconds"] <= target else "  NOT MET")
    lines = [f"  {name}: {f['seconds']} s (target {'<= ' + str(target) + ' s' if target else '-'}; "
             f"process {f.get('load_seconds')} s, graphs {f.get('graphs')}, cache hits {f.get('cache_hits')}, "
             f"misses {f.get('cache_misses')}, manifest {f.get('manifest')}, "
             f"classes loaded whole {f.get('loaded')}){verdict}"
             f"{'  ' + f['error'] if 'error' in f else ''}"]
    for key in ("saved_classes_off", "saved_classes_issue"):
        if f.get(key):
            lines.append(f"      {key}: {f[key]}")
    if "phases" in f:
        artifacts = f" + loading the artifacts {f['artifacts_seconds']} s" if f.get("artifacts_seconds") else ""
        lines.append("      by phase: " + ", ".join(f"{k} {v}" for k, v in f["phases"].items()) + artifacts
                     + "; by class: " + ", ".join(f"{k} {v}" for k, v in f["classes"].items())
                     + f"; eager forward before it {f.get('device_seconds')} s")
    return lines


def figures(report: dict) -> list[str]:
    lines = []
    for name, f in report.get("figures", {}).items():
        if name.startswith("compile_"):
            lines += compile_figure(name, f)
            continue
        rate = f"{f['tokens_per_s']:,.0f} useful tok/s" if f.get("tokens_per_s") else "-"
        checks = ", ".join(f"{k}={f[k]}" for k in ("verified", "bit_equal_compiled", "status") if k in f)
        lines.append(f"  {name}: {rate} {checks}")
        for label, values in (("worst vs eager", f.get("worst")), ("eager noise", f.get("noise")),
                              ("flip bound, derived (lowest over batches)", f.get("flip_bound"))):
            if values:
                shown = [k for k in KEY_MEASURES if k in values] or list(values)
                lines.append(f"      {label}: " + ", ".join(f"{k}={values[k]}" for k in shown))
    return lines


def main(out: Path) -> None:
    for name in ("bench_full", "bench_packed", "compile_time"):
        path = out / f"{name}.json"
        if not path.exists():
            print(f"{name}: no report (see {name}.log and status.txt)")
            continue
        report = json.loads(path.read_text())
        print(f"{name} ({report['when']}, {report['machine']['gpu']}, torch {report['machine']['torch']}):")
        print("\n".join(figures(report) + ratios(report)))
    lengths = out / "new_lengths.json"
    if lengths.exists():
        from compile_new_lengths import summary  # beside this file

        print(summary(json.loads(lengths.read_text())))
    tests = out / "gpu_tests.log"
    if tests.exists():
        lines = [line for line in tests.read_text().splitlines() if line.strip()]
        printed = [line for line in lines
                   if line.startswith(("GPU compiled", "GPU flip bound", "GPU eager", "GPU compile:"))]
        print("gpu_tests:", *(printed + lines[-1:]), sep="\n  ")
    status = out / "status.txt"
    if status.exists():
        print("steps:", *status.read_text().splitlines(), sep="\n  ")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "gpu-out"))
