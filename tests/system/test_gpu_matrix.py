"""benchmarks/gpu_matrix.py, the GPU equality matrix, in its CPU mode: every cell runs through a real
broker and worker (the pooled reply path forced on) and meets the contract (each shard bit-equal; the
assembled batch bit-equal to the unsharded forward or within the tolerance); a cell that cannot run is
reported as such instead of stopping the run."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import zygote

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_matrix.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_matrix", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_plan_covers_the_paths():
    matrix = _module()
    one_gpu, skipped = matrix.plan(["cuda:0"])
    names = [c.name for c in one_gpu]
    assert len(one_gpu) == 21 and {c.path for c in one_gpu} == {"frames", "plane"}
    assert {(c.compact, c.prefetch, c.shards) for c in one_gpu if c.kind == "eagle3" and c.path == "frames"} == {
        (compact, p, s) for compact in (False, True) for p in (1, 2, 4) for s in (1, 2)} | {
        ("auto", 2, 1), ("auto", 2, 2)}
    assert {(c.kind, c.compact, c.shards) for c in one_gpu if c.path == "plane"} == {
        ("eagle3", compact, s) for compact in (False, True) for s in (1, 2)} | {
        ("dspark", False, 1), ("eagle3", "auto", 2)}
    assert any("dspark" in n for n in names) and len(skipped) == 4  # other GPU, nccl full, compact and auto
    assert [c.compact_wire for c in one_gpu if c.compact == "auto"] == [True, True, False]  # frames, frames, plane
    two_gpus, skipped = matrix.plan(["cuda:0", "cuda:1"])
    assert not skipped and len(two_gpus) == 45
    assert {c.client_device for c in two_gpus if c.path == "nccl"} == {"cuda:1"}
    cpu, skipped = matrix.plan(["cpu"])
    assert not skipped and [c.compact for c in cpu if c.path == "nccl"] == [False, True, "auto"]  # gloo on CPU


def test_matrix_on_cpu_is_all_equal(tmp_path):
    out = tmp_path / "matrix.json"
    env = {**os.environ, "SPEC_SERVE_HOST_POOL": "1", "SPEC_SERVE_HOST_POOL_BUFFERS": "1"}
    proc = zygote.run([str(SCRIPT), "--tiny", "--device", "cpu", "--batches", "2", "--rows", "2", "--seq", "32",
                       "--json", str(out)], env, timeout=600, nested=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["all_equal"] and len(report["cells"]) == 24
    for row in report["cells"]:
        assert row["status"] == "ok" and row["equal"] == row["total"] == 2, row
        if row["shards"] > 1:  # the contract's second part was checked for every sharded batch
            assert row["unsharded_equal"] + row["unsharded_within"] == 2, row
    assert all(r["nccl_batches"] == 2 for r in report["cells"] if r["path"] == "nccl")
    assert all(r["plane_replies"] == 0 for r in report["cells"] if r["path"] == "frames")
    assert all(r["plane_replies"] == 2 * r["shards"] for r in report["cells"] if r["path"] == "plane")
    assert "ALL EQUAL" in proc.stdout and "nccl   eagle3_compact" in proc.stdout
    auto = {(r["path"], r["shards"]): r for r in report["cells"] if r["compact"] == "auto"}
    assert [auto[("frames", s)]["compact_replies"] for s in (1, 2)] == [2, 4]  # compact across "hosts"
    assert auto[("plane", 2)]["compact_replies"] == auto[("nccl", 1)]["compact_replies"] == 0  # full on one host
    assert all(r["lm_head_slices"] == 1 for (path, _), r in auto.items() if path == "frames")


def test_a_cell_that_cannot_run_is_reported(tiny_target_dir, tiny_vocab_mapping, colocated_target):
    matrix = _module()
    refs = matrix.References(colocated_target(), matrix.make_batches(1, 2, 16, 512), tiny_vocab_mapping)
    cell = matrix.Cell("frames", "eagle3", False, 1, 1, "cpu")
    start = time.monotonic()
    row = matrix.run_with_timeout(cell, "tcp://127.0.0.1:9", refs, cell_timeout=2)  # nothing listens there
    assert row["status"] in ("error", "timeout") and time.monotonic() - start < 30
    assert row["status"] in matrix.format_matrix([row], [])


def test_references_are_computed_once_and_statuses_follow_the_contract(tiny_vocab_mapping, colocated_target):
    matrix = _module()
    engine = colocated_target()
    forwards = []
    forward = engine.generate_batch
    engine.generate_batch = lambda *a, **kw: forwards.append(a[0].shape[0]) or forward(*a, **kw)
    refs = matrix.References(engine, matrix.make_batches(1, 2, 16, 512), tiny_vocab_mapping)
    sharded = matrix.Cell("frames", "eagle3", False, 1, 2, "cpu")
    first = refs.get(0, sharded)
    assert refs.get(0, sharded) is first and forwards == [1, 1]  # one forward per shard, then cached
    composition = refs.composition(0, sharded)
    # + the unsharded forward, and where this CPU computed the two compositions apart (MKL_CBWR=AVX2 here) the
    # logits the tolerance's flip allowance needs: once each, however often it is asked.
    once = [1, 1, 2] + ([] if composition["invariant"] else [2])
    assert refs.composition(0, sharded) is composition and forwards == once, (forwards, composition)
    assert composition["invariant"] or not composition["violations"], composition
    row = {"equal": 2, "total": 2, "unsharded_equal": 1, "unsharded_within": 1}
    assert matrix._status(row) == "ok"
    assert matrix._status(dict(row, unsharded_within=0)) == "OUTSIDE_TOLERANCE"
    assert matrix._status(dict(row, equal=1)) == "DIFFERS"
