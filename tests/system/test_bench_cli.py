"""``spec-serve bench`` runs end to end, prints its table and writes a JSON report (no timings asserted)."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch
from click.testing import CliRunner

from spec_serve.tools.bench import bytes_per_token
from spec_serve.tools.cli import main


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
    # The one run on the default target (bench builds the tiny target); the others pass the session's.
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
    # Every timed remote batch was compared with the colocated forward of the same input.
    for name in ("remote_1w", "remote_1w_compact"):
        assert report["figures"][name]["verified"] == "2/2" and "status" not in report["figures"][name]
    assert "verified=2/2" in result.output
    assert all(r["status"] in ("ok", "implausible") for r in report["ratios"])
    # Compact replies carry fewer bytes a token than full ones, on the wire.
    assert report["figures"]["remote_1w_compact"]["wire_bytes_per_token"] < \
        report["figures"]["remote_1w"]["wire_bytes_per_token"]
    assert "remote 1 worker / colocated" in result.output
    # No TTY here: one progress line per scenario (and one for the cluster start) on stderr.
    lines = [line for line in result.stderr.splitlines() if line.startswith("[bench] ")]
    assert [line.split()[-1] for line in lines] == ["cluster", *scenarios.split(",")]
    assert lines[-1].startswith(f"[bench] {len(lines)}/{len(lines)} ")


def test_bench_repeat_reports_medians_of_rounds(tmp_path, tiny_target_dir):
    out = tmp_path / "bench.json"
    plot = ["--plot", str(tmp_path / "ratios.png")] if importlib.util.find_spec("matplotlib") else []
    result = CliRunner().invoke(main, ["bench", "--only", "colocated,remote_1w", "--steps", "2", "--warmup", "1",
                                       "--batch", "2", "--seq", "32", "--repeat", "3", "--json", str(out), *plot,
                                       "--target", str(tiny_target_dir)])
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
    from spec_serve.tools.bench.command import main as bench_main

    with pytest.raises(SystemExit) as exit_info:
        bench_main(["--help"])
    assert exit_info.value.code == 0
    module_help = capsys.readouterr().out
    command_help = CliRunner().invoke(main, ["bench", "--help"]).output
    assert "python -m spec_serve.tools.bench" in module_help
    assert _flags(module_help) == _flags(command_help)
    assert {"--small-seq", "--small-ranks", "--plot", "--repeat", "--json", "--config"} <= _flags(module_help)


def test_module_rejects_unknown_scenario_like_the_command(capsys):
    from spec_serve.tools.bench.command import main as bench_main

    with pytest.raises(SystemExit) as exit_info:
        bench_main(["--only", "warp_drive"])
    assert exit_info.value.code == 2 and "warp_drive" in capsys.readouterr().err


def test_plot_draws_every_ratio_and_round(tmp_path):
    pytest.importorskip("matplotlib")
    from spec_serve.tools.bench_plot import plot_ratios, ratio_rounds

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


def test_bench_length_workloads(tmp_path):
    """lognormal: seeded, median near 600 at seq 2048, capped, each batch padded to its longest row;
    a JSONL file replays its rows' lengths (either spelling), truncated to seq; a bad file names its line."""
    from spec_serve.tools.bench import padded_batch, row_lengths

    drawn = row_lengths("lognormal", 500, 4, 2048)
    assert drawn == row_lengths("lognormal", 500, 4, 2048) and drawn[0] != drawn[1]
    flat = sorted(n for rows in drawn for n in rows)
    assert 500 < flat[len(flat) // 2] < 700 and max(flat) == 2048 and min(flat) >= 2
    real_share = sum(map(sum, drawn)) / sum(4 * max(rows) for rows in drawn)
    assert 0.5 < real_share < 0.62
    ids, attn, loss = padded_batch([5, 3], vocab=50, seed=0)
    assert attn.tolist() == [[1] * 5, [1, 1, 1, 0, 0]] and not bool(ids[attn == 0].any())
    assert not bool(loss[attn == 0].any()) and loss.sum() > 0
    data = tmp_path / "lengths.jsonl"
    data.write_text('{"length": 7}\n\n{"input_ids": [1, 2, 3]}\n{"length": 5000}\n')
    replayed = row_lengths(str(data), 20, 4, 64)
    assert {n for rows in replayed for n in rows} == {7, 3, 64}
    data.write_text('{"length": 7}\n{"tokens": [1]}\n')
    result = CliRunner().invoke(main, ["bench", "--only", "colocated", "--lengths", str(data)])
    assert result.exit_code != 0 and "lengths.jsonl:2" in result.output


def test_bench_packed_scenarios_verify_every_batch(tmp_path, tiny_target_dir):
    """The packing scenarios on log-normal lengths: useful and padded tokens/s, and every timed batch
    checked against the colocated padded forward (verified=N/N)."""
    out = tmp_path / "bench.json"
    scenarios = "colocated,colocated_packed,remote_1w_packed,remote_1w_compact_packed"
    result = CliRunner().invoke(main, ["bench", "--only", scenarios, "--steps", "3", "--warmup", "1",
                                       "--seq", "64", "--lengths", "lognormal", "--json", str(out),
                                       "--target", str(tiny_target_dir)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    for name, figure in report["figures"].items():
        assert figure["padded_tokens"] > figure["tokens"] > 0, name
        assert figure["padded_tokens_per_s"] > figure["tokens_per_s"], name
    for name in ("colocated_packed", "remote_1w_packed", "remote_1w_compact_packed"):
        figure = report["figures"][name]
        assert figure["verified"] == "3/3" and "status" not in figure, figure
        assert figure["worst"]["position_mask.flip_rate"] == 0.0
    ratios = {r["ratio"] for r in report["ratios"]}
    assert "packed / padded forward, colocated (useful tokens/s)" in ratios
    assert "verified=3/3" in result.output


def test_verify_packed_flags_a_wrong_batch(tiny_target_dir, colocated_target):
    from spec_serve.tools.bench import verify_packed
    from spec_serve.tools.tiny import sample_batch

    engine = colocated_target()
    batches = [sample_batch(tiny_target_dir, 2, 16, seed=s) for s in range(2)]
    outputs = engine.generate_packed(batches)
    assert verify_packed(engine, batches, outputs)["verified"] == "2/2"
    outputs[1]["aux_hidden_states"] = outputs[1]["aux_hidden_states"].clone()
    outputs[1]["aux_hidden_states"][0, 0, 0] += 1e-3  # one element of one real position
    checked = verify_packed(engine, batches, outputs)
    assert checked["verified"] == "1/2" and checked["status"] == "INVALID"
    assert checked["first_failures"][0].startswith("aux_hidden_states: max_error")


def test_a_wrong_batch_voids_its_ratios(tmp_path, monkeypatch, tiny_target_dir):
    """One timed batch unequal to the colocated forward: the scenario reports verified=1/2 and every
    ratio it is part of prints INVALID instead of a value."""
    from spec_serve.tools.bench import Context

    keep = Context.keep_reference

    def one_wrong(self, i, out, **kwargs):  # the colocated answer remote_1w's first timed batch is checked against
        keep(self, i, dict(out, aux_hidden_states=out["aux_hidden_states"] + 1) if i == 1 else out, **kwargs)

    monkeypatch.setattr(Context, "keep_reference", one_wrong)
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(main, ["bench", "--only", "colocated,remote_1w", "--steps", "2", "--warmup", "1",
                                       "--batch", "2", "--seq", "32", "--json", str(out),
                                       "--target", str(tiny_target_dir)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    figure = report["figures"]["remote_1w"]
    assert figure["verified"] == "1/2" and figure["status"] == "INVALID"
    (ratio,) = [r for r in report["ratios"] if r["ratio"] == "remote 1 worker / colocated"]
    assert ratio["status"] == "invalid" and ratio["value"] is None
    line = next(x for x in result.output.splitlines() if x.startswith("remote 1 worker / colocated"))
    assert "INVALID" in line


def test_remote_faster_than_colocated_is_flagged():
    from spec_serve.tools.bench import format_table
    from spec_serve.tools.bench.report import _ratio

    def figure(name, rate):
        return {"scenario": name, "tokens": 100, "bytes": 1, "seconds": 1.0, "tokens_per_s": rate, "gb_per_s": 0.1}

    rounds = [{"colocated": figure("colocated", 1000.0), "remote_1w": figure("remote_1w", 1200.0),
               "remote_1w_packed": figure("remote_1w_packed", 1500.0)}]
    ratio = _ratio("remote 1 worker / colocated", "remote_1w", "colocated", 0.95, rounds[0], rounds)
    assert ratio["status"] == "implausible" and ratio["value"] == 1.2
    # A packing worker skips the padding: faster than the padded colocated forward is its point.
    assert _ratio("p", "remote_1w_packed", "colocated", 1.5, rounds[0], rounds)["status"] == "ok"
    report = {"figures": rounds[0], "ratios": [ratio], "bytes_per_token": {
        "llama_8b_shape_vd32000_bf16": {"eagle3": 2, "eagle3_compact": 1}, "this_target": {"eagle3": 2,
        "eagle3_compact": 1}, "measured": {}}}
    assert "IMPLAUSIBLE" in format_table(report)
    rounds = [{"colocated": figure("colocated", 1000.0), "remote_1w": figure("remote_1w", 1050.0)}]
    assert _ratio("r", "remote_1w", "colocated", None, rounds[0], rounds)["status"] == "ok"


def test_fingerprint_tells_equal_tensors_from_changed_ones():
    """The bench's check of batches it does not keep: equal tensors agree; one flipped bit, two rows swapped,
    another shape or dtype are told apart (``verify.fingerprint``)."""
    from spec_serve.tools.verify import fingerprint, fingerprint_mismatch

    gen = torch.Generator().manual_seed(0)
    batch = {"aux": torch.randn(4, 33, 8, generator=gen).to(torch.bfloat16),
             "mask": torch.rand(4, 33, generator=gen) > 0.5}
    assert fingerprint_mismatch(fingerprint({k: v.clone() for k, v in batch.items()}), fingerprint(batch)) is None
    flipped = batch["mask"].clone()
    flipped[3, 32] = ~flipped[3, 32]
    swapped = batch["aux"][[1, 0, 2, 3]]
    for changed, why in ((dict(batch, mask=flipped), "mask: bytes differ"),
                         (dict(batch, aux=swapped), "aux: bytes differ"),
                         (dict(batch, aux=batch["aux"][:, :32]), "aux: torch.bfloat16[4, 32, 8]"),
                         (dict(batch, aux=batch["aux"].float()), "aux: torch.float32")):
        assert fingerprint_mismatch(fingerprint(changed), fingerprint(batch)).startswith(why)
