"""``spec-serve bench`` runs end to end, prints its table and writes a JSON report (no timings asserted)."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
from click.testing import CliRunner

from spec_serve.bench import bytes_per_token
from spec_serve.cli import main


def test_bytes_per_token_at_8b_shape():
    got = bytes_per_token(4096, 32000, 2)
    assert got["eagle3_compact"] <= 33 * 1024 < 152 * 1024 - 4096 < got["eagle3"]


def test_bench_help_has_examples():
    result = CliRunner().invoke(main, ["bench", "--help"])
    assert result.exit_code == 0 and "--gpu-8b" in result.output and "Examples" in result.output


def test_bench_rejects_unknown_scenario():
    result = CliRunner().invoke(main, ["bench", "--only", "warp_drive"])
    assert result.exit_code != 0 and "warp_drive" in result.output


def test_bench_runs_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    scenarios = "colocated,colocated_compact,remote_1w,remote_1w_compact,zmq_raw,frames"
    result = CliRunner().invoke(main, ["bench", "--only", scenarios, "--steps", "2", "--warmup", "1",
                                       "--batch", "2", "--seq", "32", "--transport-seq", "16",
                                       "--transport-messages", "2", "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert set(report["figures"]) == set(scenarios.split(","))
    for figure in report["figures"].values():
        assert figure["seconds"] > 0 and figure["bytes"] > 0
    ratios = {r["ratio"]: r["value"] for r in report["ratios"]}
    assert "remote 1 worker / colocated" in ratios and "frames / raw ZeroMQ (same bytes)" in ratios
    # Compact replies carry fewer bytes a token than full ones, on the wire.
    assert report["figures"]["remote_1w_compact"]["wire_bytes_per_token"] < \
        report["figures"]["remote_1w"]["wire_bytes_per_token"]
    assert "remote 1 worker / colocated" in result.output
    # No TTY here: one progress line per scenario (and one for the cluster start) on stderr.
    lines = [line for line in result.stderr.splitlines() if line.startswith("[bench] ")]
    assert [line.split()[-1] for line in lines] == ["cluster", *scenarios.split(",")]
    assert lines[-1].startswith(f"[bench] {len(lines)}/{len(lines)} ")


def test_bench_repeat_reports_medians_of_rounds(tmp_path):
    out = tmp_path / "bench.json"
    plot = ["--plot", str(tmp_path / "ratios.png")] if importlib.util.find_spec("matplotlib") else []
    result = CliRunner().invoke(main, ["bench", "--only", "colocated,remote_1w", "--steps", "2", "--warmup", "1",
                                       "--batch", "2", "--seq", "32", "--repeat", "3", "--json", str(out), *plot])
    assert result.exit_code == 0, result.output
    if plot:
        assert (tmp_path / "ratios.png").read_bytes()[:4] == b"\x89PNG"
    report = json.loads(out.read_text())
    for figure in report["figures"].values():
        rates = figure["rounds"]
        assert len(rates) == 3 and figure["tokens_per_s"] == sorted(rates)[1]
    (ratio,) = [r for r in report["ratios"] if r["ratio"] == "remote 1 worker / colocated"]
    assert len(ratio["rounds"]) == 3 and ratio["value"] == sorted(ratio["rounds"])[1]


def _flags(help_text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]+", help_text))


def test_module_and_command_are_one_parser(capsys):
    from spec_serve import bench

    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--help"])
    assert exit_info.value.code == 0
    module_help = capsys.readouterr().out
    command_help = CliRunner().invoke(main, ["bench", "--help"]).output
    assert "python -m spec_serve.bench" in module_help
    assert _flags(module_help) == _flags(command_help)
    assert {"--small-seq", "--small-ranks", "--plot", "--repeat", "--json", "--config"} <= _flags(module_help)


def test_module_rejects_unknown_scenario_like_the_command(capsys):
    from spec_serve import bench

    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--only", "warp_drive"])
    assert exit_info.value.code == 2 and "warp_drive" in capsys.readouterr().err


def test_plot_draws_every_ratio_and_round(tmp_path):
    pytest.importorskip("matplotlib")
    from spec_serve.bench_plot import plot_ratios, ratio_rounds

    report = {"when": "now", "ratios": [
        {"ratio": "remote 1 worker / colocated", "value": 0.9, "h200_target": 0.95, "rounds": [0.8, 0.9, 1.0]},
        {"ratio": "frames / raw ZeroMQ (same bytes)", "value": 0.7, "h200_target": 0.9},
        {"ratio": "2 workers / 1 worker", "value": None, "h200_target": 1.9},
    ]}
    assert ratio_rounds(report) == [("remote 1 worker / colocated", [0.8, 0.9, 1.0], 0.9, 0.95),
                                    ("frames / raw ZeroMQ (same bytes)", [0.7], 0.7, 0.9)]
    out = tmp_path / "ratios.png"
    plot_ratios(report, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_fails_before_running(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    result = CliRunner().invoke(main, ["bench", "--only", "colocated", "--plot", str(tmp_path / "p.png"),
                                       "--json", str(tmp_path / "b.json")])
    assert result.exit_code == 2 and "pip install" in result.output
    assert not (tmp_path / "b.json").exists()
