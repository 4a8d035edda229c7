"""``spec-serve bench`` runs end to end, prints its table and writes a JSON report (no timings asserted)."""

from __future__ import annotations

import json

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


def test_bench_repeat_reports_medians_of_rounds(tmp_path):
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(main, ["bench", "--only", "colocated,remote_1w", "--steps", "2", "--warmup", "1",
                                       "--batch", "2", "--seq", "32", "--repeat", "3", "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    for figure in report["figures"].values():
        rates = figure["rounds"]
        assert len(rates) == 3 and figure["tokens_per_s"] == sorted(rates)[1]
    (ratio,) = [r for r in report["ratios"] if r["ratio"] == "remote 1 worker / colocated"]
    assert len(ratio["rounds"]) == 3 and ratio["value"] == sorted(ratio["rounds"])[1]
