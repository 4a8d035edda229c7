"""Compiled decoder layers (``HFTarget(compile=True)``, ``--compile``; docs/compile.md) on CPU float32.

What costs here is Inductor building C++ (g++, seconds of CPU a kernel on a loaded 2-core box), so exactly one
engine compiles with Inductor, and only the two batch classes its checks need: single full rows (what a worker's
load-time probe sends) and packed sequences of several rows. It saves those classes (engines/precompiled.py) in an
Inductor cache of this module's own, from which the worker test's worker and the bench test's worker and colocated
engine load them whole instead of compiling them again. The checks of the plumbing (one graph per batch class
serving every layer, classes saved and loaded, recompiles counted and logged, the fall back to eager, metrics)
compile every class with AOTAutograd's ``aot_eager`` backend (``compiled.TEST_BACKEND_ENV``), or dynamo's ``eager``
where saving is not the point: the same graphs, guards and classes, without code generation; compiled that way
answers equal eager ones bit for bit, which checks the capture hooks around compiled layers exactly. Every Inductor
answer must lie within ``compiled.TOLERANCE`` of the eager forward, and a compiled worker's answers must equal the
compiled colocated engine's bit for bit. Workers run with one math thread, so the colocated engines here do too.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

import zygote
from spec_serve.client.api import RemoteTargetModel
from spec_serve.engines import compiled, packing, precompiled
from spec_serve.engines.flips import flip_bound
from spec_serve.engines.hf import HFTarget
from spec_serve.supervision import contract
from spec_serve.supervision.eagle3 import lm_head_slice
from spec_serve.supervision.tolerance import ReferenceLogits
from spec_serve.telemetry.metrics import CompileCollector
from spec_serve.tools.bench import LLAMA_8B_CONFIG, padded_batch, row_lengths
from spec_serve.tools.launch import free_port, local_cluster
from spec_serve.tools.tiny import make_tiny_target, sample_batch
from spec_serve.tools.verify import expanded, mismatch, reference_logits, tolerance_for
from spec_serve.worker import threads as worker_threads

FP32 = compiled.TOLERANCE[torch.float32]
KINDS = ("eagle3", "dspark", "eagle3_compact")
# The classes the Inductor engine compiles (and the worker test's worker loads): the probe's, and packed.
INDUCTOR_CLASSES = "row,packed"
# Why the plumbing engine's aot_eager classes are not saved on this torch (2.11 cannot save that backend's
# output; Inductor's it can), or None.
AOT_EAGER_UNSAVED = precompiled.unavailable_reason("aot_eager")


def as_eager(got, want, batch) -> str | None:
    """What differs between a compiled engine's answer (an eager backend) and eager's, over the positions the
    contract holds compiled answers to (``packing.compare``'s real positions): compiled layers take right-padded
    rows without the padding mask, so padded positions hold values of their own (docs/compile.md)."""
    off = {name: m for name, m in packing.compare(got, want, batch[1]).items() if any(m.values())}
    return str(off) if off else None


@pytest.fixture(scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory):
    """This module's own Inductor cache (empty at start, as on a clean machine), for its one Inductor engine
    and the worker pointed at it."""
    path = tmp_path_factory.mktemp("inductor-cache")
    with pytest.MonkeyPatch.context() as env:
        env.setenv(compiled.CACHE_ENV, str(path))
        yield path


@pytest.fixture(scope="module")
def inductor_engine(one_thread, inductor_cache, tiny_target_dir, tiny_vocab_mapping):
    with pytest.MonkeyPatch.context() as env:
        env.setenv(compiled.TEST_CLASSES_ENV, INDUCTOR_CLASSES)
        engine = HFTarget(tiny_target_dir, compile=True, compile_cache=inductor_cache)
    engine.set_vocab_mapping(*tiny_vocab_mapping)
    return engine


@pytest.fixture(scope="module")
def plumbing_engine(one_thread, inductor_engine, tiny_target_dir, tiny_vocab_mapping, tmp_path_factory):
    """Every WARMUP class compiled ahead of time with the aot_eager backend and saved (in a cache of its own);
    after the Inductor engine, whose recompiles through dynamo so start from the state a fresh worker's do."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv(compiled.TEST_BACKEND_ENV, "aot_eager")
        engine = HFTarget(tiny_target_dir, compile=True, compile_cache=tmp_path_factory.mktemp("plumbing-cache"))
    engine.set_vocab_mapping(*tiny_vocab_mapping)
    return engine


@pytest.fixture(scope="module")
def eager_engine(one_thread, colocated_target):
    return colocated_target()


def _metrics(engine) -> CollectorRegistry:
    """The engine's compile metrics, as a worker's /metrics renders them."""
    registry = CollectorRegistry()
    registry.register(CompileCollector(lambda: engine.compile_report))
    return registry


def _batches(target_dir):
    """One batch of each padded class (several rows or one, full or padded), at lengths other than the
    warm-up's."""
    batches = []
    for seed, (rows, seq, padded) in enumerate(((4, 48, True), (3, 40, False), (1, 33, False), (1, 20, True))):
        ids, attn, loss = sample_batch(target_dir, rows, seq, seed=seed)
        if padded:
            attn[-1, seq // 3:] = 0
            loss[-1, seq // 3:] = 0
        batches.append((ids, attn, loss))
    return batches


def _packed_requests(target_dir):
    return [sample_batch(target_dir, rows, seq, seed=10 + s) for s, (rows, seq) in enumerate(((1, 24), (3, 40),
                                                                                             (2, 17), (1, 64)))]


class _propagating:
    """Let the spec_serve logger reach caplog even after ``logs.setup`` (which stops its propagation)."""

    def __enter__(self):
        self.logger = logging.getLogger("spec_serve")
        self.before, self.logger.propagate = self.logger.propagate, True

    def __exit__(self, *exc):
        self.logger.propagate = self.before


def _row_noise(engine, batch) -> dict[str, float]:
    """The eager forward's batch-composition noise: each row alone against the same row in its batch (right
    padded), held to the contract's derived tolerance (docs/equality.md); returns the worst of each measure."""
    ids, attn, loss = batch
    inside = engine.generate_batch(ids, attn, loss)
    logits, tolerance = reference_logits(engine, batch), tolerance_for(engine)
    worst: dict[str, float] = {}
    for row, n in enumerate(attn.sum(1).tolist()):
        alone = engine.generate_batch(ids[row:row + 1, :n], attn[row:row + 1, :n], loss[row:row + 1, :n])
        same = {name: t[row:row + 1, :n] for name, t in inside.items()}
        # Next-token tensors where the next token is the row's own (alone, position n-1 has none).
        cut = {"aux_hidden_states": n, "target_probs": n - 1, "position_mask": n - 1}
        margins = ReferenceLogits(logits.scale, logits.margins[row:row + 1, :n - 1])
        beyond = tolerance.violations({k: alone[k][:, :m] for k, m in cut.items()},
                                      {k: same[k][:, :m] for k, m in cut.items()}, margins)
        assert beyond == [], (row, n, beyond)
        for name, measures in packing.compare(alone, same, attn[row:row + 1, :n]).items():
            for measure, value in measures.items():
                if measure != "mismatch":  # input_ids, loss_mask: the last position's next token differs
                    worst[f"{name}.{measure}"] = max(worst.get(f"{name}.{measure}", 0.0), value)
    return worst


def _worst(into: dict[str, float], report: dict[str, dict[str, float]]) -> None:
    for name, measures in report.items():
        for measure, value in measures.items():
            into[f"{name}.{measure}"] = max(into.get(f"{name}.{measure}", 0.0), value)


def test_one_compile_serves_every_layer(plumbing_engine):
    """Each warm-up class compiled one graph for all 8 layers (8 per class if each layer compiled its own), saved
    as one function, the report says where the load's seconds went, and the worker's metrics say so."""
    report = plumbing_engine.compile_report
    assert report.active and report.reason is None, report
    assert report.graphs == len(compiled.WARMUP) and list(report.classes) == list(compiled.WARMUP), report
    forwards = [layer.__dict__.get("forward") for layer in plumbing_engine._layers]
    if AOT_EAGER_UNSAVED is None:
        assert all(isinstance(f, precompiled.LayerForward) for f in forwards)
        saved = forwards[0].saved
        assert all(f.saved is saved for f in forwards) and saved.compiled == list(compiled.WARMUP), saved.compiled
        assert len(saved.functions) == len(compiled.WARMUP) and report.loaded == 0 and report.saved_classes_off is None
        assert sorted(p.name for p in saved.directory.iterdir()) == sorted(saved.path(n).name for n in compiled.WARMUP)
    else:  # traced by dynamo, as with saving off
        assert all(f is not None for f in forwards) and report.saved_classes_off == AOT_EAGER_UNSAVED, report
    assert set(report.phases) == {*compiled.PHASE_TIMERS, "load", "other"} and report.phases["trace"] > 0, report
    assert sum(report.phases.values()) == pytest.approx(report.seconds, abs=0.05), report
    assert 0 < sum(report.classes.values()) <= report.seconds + 0.05 and report.device_seconds > 0, report
    exported = _metrics(plumbing_engine)
    assert exported.get_sample_value("spec_serve_worker_compile_graphs_total") == report.graphs
    assert exported.get_sample_value("spec_serve_worker_compile_classes_loaded_total") == 0
    assert exported.get_sample_value("spec_serve_worker_compile_seconds_total", {"phase": "load"}) == report.seconds
    assert exported.get_sample_value("spec_serve_worker_compiled") == 1
    assert exported.get_sample_value("spec_serve_worker_compile_fallbacks_total") == 0


@pytest.mark.skipif(AOT_EAGER_UNSAVED is not None, reason=f"{AOT_EAGER_UNSAVED} (the Inductor worker test loads)")
def test_saved_classes_load_whole_and_a_broken_one_is_compiled_again(plumbing_engine, eager_engine, tiny_target_dir,
                                                                    tiny_vocab_mapping, tmp_path, monkeypatch, caplog):
    """A second engine on (a copy of) the plumbing engine's cache loads the saved classes whole: nothing traced,
    answers unchanged. One saved file cut short does not load: that class alone is compiled again, with one INFO
    line naming the file, and saved anew."""
    cache, source = tmp_path / "cache", Path(plumbing_engine.compile_report.cache_dir)
    shutil.copytree(source, cache)
    broken = cache / plumbing_engine._layers[0].forward.saved.path("row").relative_to(source)
    broken.write_bytes(broken.read_bytes()[:1000])
    monkeypatch.setenv(compiled.TEST_BACKEND_ENV, "aot_eager")
    with caplog.at_level(logging.INFO, logger="spec_serve.engines.compiled"), _propagating():
        engine = HFTarget(tiny_target_dir, compile=True, compile_cache=cache)
    engine.set_vocab_mapping(*tiny_vocab_mapping)
    report, saved = engine.compile_report, engine._layers[0].forward.saved
    assert report.loaded == len(compiled.WARMUP) - 1 and report.graphs == 1, report
    assert saved.compiled == ["row"] and saved.loaded == [n for n in compiled.WARMUP if n != "row"], saved.loaded
    assert report.phases["load"] > 0, report
    unusable = [r.getMessage() for r in caplog.records if "compile.saved_class_unusable" in r.getMessage()]
    assert len(unusable) == 1 and str(broken) in unusable[0], unusable
    assert broken.stat().st_size > 1000
    for batch in _batches(tiny_target_dir):
        assert as_eager(engine.generate_batch(*batch), eager_engine.generate_batch(*batch), batch) is None
    assert engine.compile_report.recompiles == 0


@pytest.mark.skipif(AOT_EAGER_UNSAVED is not None, reason=f"{AOT_EAGER_UNSAVED} (nothing saved to share)")
def test_saved_classes_serve_another_target_of_the_same_config(plumbing_engine, tiny_vocab_mapping, tmp_path,
                                                               monkeypatch, caplog):
    """Issue 40: saved classes serve every target of one configuration, dtype, device and math-thread count. A
    second tiny target (other weights, its own directory) loads the plumbing engine's classes whole, traces
    nothing, and answers as its own eager forward bit for bit (aot_eager runs eager's kernels), not as the first
    target. A load at another thread count is keyed apart: dynamo's guards check torch's thread count, so before,
    every saved class refused it ("its guards refuse the warm-up's call") and was compiled again and replaced,
    and the next load at the first count did the same; now it compiles its own and leaves the others' be."""
    other = make_tiny_target(tmp_path / "other-weights", seed=7)
    cache = tmp_path / "cache"
    shutil.copytree(plumbing_engine.compile_report.cache_dir, cache)
    monkeypatch.setenv(compiled.TEST_BACKEND_ENV, "aot_eager")
    with caplog.at_level(logging.INFO, logger="spec_serve.engines.compiled"), _propagating():
        engine = HFTarget(other, compile=True, compile_cache=cache)
        report = engine.compile_report
        assert report.loaded == len(compiled.WARMUP) and report.graphs == 0, report
        engine.set_vocab_mapping(*tiny_vocab_mapping)
        eager = HFTarget(other)
        eager.set_vocab_mapping(*tiny_vocab_mapping)
        for batch in _batches(other):
            assert as_eager(engine.generate_batch(*batch), eager.generate_batch(*batch), batch) is None
        assert mismatch(engine.generate_batch(*batch), plumbing_engine.generate_batch(*batch)) is not None
        assert engine.compile_report.recompiles == 0
        files = {path: path.read_bytes() for path in Path(report.saved_classes).iterdir()}
        monkeypatch.setenv(compiled.TEST_CLASSES_ENV, "rows")
        before = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            apart = HFTarget(other, compile=True, compile_cache=cache).compile_report
        finally:
            torch.set_num_threads(before)
    assert apart.saved_classes != report.saved_classes and apart.graphs == 1 and apart.loaded == 0, apart
    assert not [r for r in caplog.records if "compile.saved_class_unusable" in r.getMessage()]
    assert {path: path.read_bytes() for path in Path(report.saved_classes).iterdir()} == files


def test_a_compiled_worker_on_new_lengths_equals_colocated_without_recompiling(plumbing_engine, tiny_target_dir,
                                                                              tiny_vocab_mapping, tmp_path):
    """Issue 40: a fresh ``--compile`` worker (no --packing) fed log-normal batches whose lengths neither it nor the
    colocated compiled engine has met: each answer, every kind, equals the colocated ``HFTarget(compile=True)``'s bit
    for bit, batch by batch, and nothing recompiles after load on either side (the worker's /metrics and log, the
    engine's report). The worker loads the classes the plumbing engine saved (aot_eager)."""
    batches = [padded_batch(rows, 512, seed=100 + i) for i, rows in enumerate(row_lengths("lognormal", 6, 4, 96))]
    assert len({b[0].shape[1] for b in batches}) >= 4 and not any(b[1].all() for b in batches)
    before = plumbing_engine.compile_report.recompiles
    port = free_port()
    args = ["--device", "cpu", "--compile", "--compile-cache", plumbing_engine.compile_report.cache_dir,
            "--http-port", str(port)]
    with local_cluster(tiny_target_dir, workers=1, worker_args=args, env={compiled.TEST_BACKEND_ENV: "aot_eager"},
                       log_dir=tmp_path, ready_timeout=300) as cluster:
        with RemoteTargetModel(cluster.frontend, prefetch_depth=2, timeout=300) as client:
            client.set_vocab_mapping(*tiny_vocab_mapping)
            for i, batch in enumerate(batches):
                for kind in ("eagle3", "dspark"):
                    want = plumbing_engine.generate_batch(*batch, kind=kind)
                    assert mismatch(client.generate_batch(*batch, kind=kind), want) is None, (i, kind)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
    recompiles = [s.value for family in text_string_to_metric_families(text) for s in family.samples
                  if s.name == "spec_serve_worker_compile_recompiles_total"]
    assert recompiles == [0] and plumbing_engine.compile_report.recompiles == before
    log = cluster.log_path("worker0").read_text()
    assert "compile.recompiled" not in log, log
    if AOT_EAGER_UNSAVED is None:
        assert re.search(r"compile\.done .*graphs=0 loaded=4 ", log), log


def test_a_kept_thread_share_is_not_recounted(monkeypatch):
    """A compiled worker keeps its share (``ThreadShare.freeze``): a recount that would give it other threads (a
    worker of the same broker came or went) leaves them as they are, where before it changed torch's threads and,
    with them, what every compiled class's guards admit (all of them recompiled)."""
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the share writes it; its value before comes back after
    share = worker_threads.ThreadShare(None)
    monkeypatch.setattr(worker_threads, "default_threads", lambda broker_url=None: 2)
    try:
        assert share.apply() == 2 and torch.get_num_threads() == 2
        share.freeze("compiled layers")
        monkeypatch.setattr(worker_threads, "default_threads", lambda broker_url=None: 3)
        share._next_recount = 0.0
        share.rebalance()
        assert share.threads == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_saving_classes_turned_off_traces_every_load(tiny_target_dir, monkeypatch, caplog):
    """SPEC_SERVE_COMPILE_SAVE_CLASSES=0: the layers are dynamo's compiled forwards, nothing saved, and the
    start line says why."""
    monkeypatch.setenv(compiled.SAVE_CLASSES_ENV, "0")
    monkeypatch.setenv(compiled.TEST_BACKEND_ENV, "aot_eager")
    monkeypatch.setenv(compiled.TEST_CLASSES_ENV, "rows")
    with caplog.at_level(logging.INFO, logger="spec_serve.engines.compiled"), _propagating():
        engine = HFTarget(tiny_target_dir, compile=True)
    report = engine.compile_report
    assert report.active and report.saved_classes is None, report
    assert report.saved_classes_off == f"{compiled.SAVE_CLASSES_ENV}=0", report
    assert not any(isinstance(layer.forward, precompiled.LayerForward) for layer in engine._layers)
    start = [r.getMessage() for r in caplog.records if "compile.start" in r.getMessage()]
    assert len(start) == 1 and f"saved_classes='off ({compiled.SAVE_CLASSES_ENV}=0)'" in start[0], start


def test_an_engine_that_never_packs_compiles_no_packed_class(plumbing_engine, eager_engine, tiny_target_dir,
                                                            tiny_vocab_mapping, monkeypatch, caplog):
    """``compile_packed=False`` (a worker without --packing): the load compiles the padded classes, in WARMUP's
    order, and says so; a packed forward, should one come after all, is still answered right. (After the plumbing
    engine, so that this one, of another history, does not change the Inductor engine's graphs.)"""
    monkeypatch.setenv(compiled.TEST_BACKEND_ENV, "eager")
    with caplog.at_level(logging.INFO, logger="spec_serve.engines.compiled"), _propagating():
        engine = HFTarget(tiny_target_dir, compile=True, compile_packed=False)
    engine.set_vocab_mapping(*tiny_vocab_mapping)
    padded = [name for name, shape in compiled.WARMUP.items() if not shape[3]]
    assert padded == ["rows", "rows_padded", "row", "row_padded"]
    assert engine.compile_report.active and list(engine.compile_report.classes) == padded, engine.compile_report
    start = [r.getMessage() for r in caplog.records if "compile.start" in r.getMessage()]
    assert len(start) == 1 and f"classes={','.join(padded)} " in start[0], start
    request = _packed_requests(tiny_target_dir)[:1]
    assert mismatch(engine.generate_packed(request)[0], eager_engine.generate_packed(request)[0]) is None


def test_a_worker_without_packing_compiles_no_packed_class(tiny_target_dir, tmp_path):
    """``spec-serve worker --compile`` without --packing never gets a packed forward: its load compiles the
    padded classes only (dynamo's eager backend here: what is checked is which classes, not kernels)."""
    padded = ",".join(name for name, shape in compiled.WARMUP.items() if not shape[3])
    with local_cluster(tiny_target_dir, workers=1, worker_args=["--device", "cpu", "--compile"],
                       env={compiled.TEST_BACKEND_ENV: "eager"}, log_dir=tmp_path, ready_timeout=300) as cluster:
        log = cluster.log_path("worker0").read_text()
    assert re.search(rf"INFO \S+ compile\.start .*classes={padded} ", log), log
    done = [line for line in log.splitlines() if " compile.done " in line]
    assert len(done) == 1 and "classes=rows:" in done[0] and "packed:" not in done[0], log


def test_the_manifest_covers_a_load_of_fewer_classes(tmp_path):
    """A manifest records the classes a load compiled, in order; a later load of the first of them (a worker
    without --packing after a packing one) expects only cache hits, one of other classes or another order does
    not, and a load that the manifest covers leaves it as it is."""
    path = tmp_path / "manifest.json"
    every = compiled.CompileReport(classes={name: 1.0 for name in compiled.WARMUP})
    compiled._record(path, every)
    assert compiled._cached(path, list(compiled.WARMUP)) and compiled._cached(path, list(compiled.WARMUP)[:4])
    assert not compiled._cached(path, ["row", "packed"]) and not compiled._cached(tmp_path / "none.json", ["rows"])
    compiled._record(path, compiled.CompileReport(classes={"rows": 1.0}))
    assert compiled._recorded(path) == list(compiled.WARMUP)


def test_every_batch_class_runs_a_load_time_graph(plumbing_engine, eager_engine, tiny_target_dir):
    """Every padded class and packed groups of 1 to 7 rows, every kind, at lengths the load did not see: no
    graph compiled, and (eager backend) the answers of the compiled layers equal eager's bit for bit."""
    for batch in _batches(tiny_target_dir):
        for kind in KINDS:
            got = plumbing_engine.generate_batch(*batch, kind=kind)
            assert as_eager(got, eager_engine.generate_batch(*batch, kind=kind), batch) is None, kind
    requests = _packed_requests(tiny_target_dir)
    for group in (requests[:1], requests[1:3], requests):
        for got, want in zip(plumbing_engine.generate_packed(group), eager_engine.generate_packed(group)):
            assert mismatch(got, want) is None
    assert plumbing_engine.compile_report.recompiles == 0


def test_compiled_layers_run_without_cudnn_attention(plumbing_engine, tiny_target_dir):
    """cuDNN's attention builds an execution plan for each new sequence length, so a fresh worker ran its first
    batches of new lengths slower than the same lengths later (issue 40): compiled layers run, as packed rows do,
    with flash, memory-efficient or math attention only, in every forward (and were compiled so), and the flags
    come back after it."""
    seen: list[bool] = []
    hook = plumbing_engine._layers[0].register_forward_pre_hook(
        lambda *_: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
    try:
        plumbing_engine.generate_batch(*_batches(tiny_target_dir)[0])
    finally:
        hook.remove()
    assert seen == [False] and torch.backends.cuda.cudnn_sdp_enabled()


def test_right_padded_rows_reach_compiled_layers_without_the_padding_mask(plumbing_engine, eager_engine,
                                                                        tiny_target_dir):
    """Issue 40: a padding mask made the compiled layers' attention the memory-efficient kernel (cuDNN is kept out
    of them and flash takes no mask), which ran batches padded to 2048 at 1.02-1.08x eager on an H100 against
    1.2x for full rows. Right-padded rows need no mask under the causal one: the layers get none, and every real
    position answers as eager's does (bit for bit with the eager backend). A batch with a left-padded row keeps
    its mask, and then every position answers as eager's."""
    masks: list[bool] = []
    hook = plumbing_engine._layers[0].register_forward_pre_hook(
        lambda _module, _args, kwargs: masks.append(kwargs.get("attention_mask") is None), with_kwargs=True)
    right = _batches(tiny_target_dir)[0]
    ids, attn, loss = (t.clone() for t in right)
    attn[0] = torch.roll(attn[-1], shifts=attn.shape[1] // 2)  # a row whose padding comes first
    assert bool((attn[0] == 0).any()) and not contract.right_padded(attn)
    try:
        right_answer = plumbing_engine.generate_batch(*right, kind="dspark")
        left_answer = plumbing_engine.generate_batch(ids, attn, loss, kind="dspark")
    finally:
        hook.remove()
    assert masks == [True, False]
    assert as_eager(right_answer, eager_engine.generate_batch(*right, kind="dspark"), right) is None
    assert mismatch(left_answer, eager_engine.generate_batch(ids, attn, loss, kind="dspark")) is None


def test_compiled_within_tolerance_of_eager(inductor_engine, eager_engine, tiny_target_dir):
    """Inductor's kernels on single rows, every kind: within TOLERANCE of eager, flips within the bound derived
    for the batch, yet not eager's bits (the compiled kernels ran), and no batch compiled anything new."""
    report = inductor_engine.compile_report
    assert report.active and report.graphs == 2 and report.loaded == 0 and report.saved_classes, report
    worst: dict[str, float] = {}
    differs = False
    for batch in (sample_batch(tiny_target_dir, 1, seq, seed=20 + seq) for seq in (33, 57, 20)):
        for kind in KINDS:
            got = inductor_engine.generate_batch(*batch, kind=kind)
            want = eager_engine.generate_batch(*batch, kind=kind)
            compared = packing.compare(got, want, batch[1])
            bounds = flip_bound(eager_engine, batch, FP32.hidden_rel_norm, kind, reference=want)
            assert packing.violations(compared, FP32, bounds) == [], (kind, compared, bounds)
            differs |= mismatch(got, want) is not None
            _worst(worst, compared)
    assert differs
    assert inductor_engine.compile_report.recompiles == 0
    print("\ncompiled vs eager, float32, single rows, worst:", {k: f"{v:.2g}" for k, v in sorted(worst.items())})


def test_compiled_packed_rows_within_tolerance_without_recompiling(inductor_engine, eager_engine, tiny_target_dir):
    """Packed forwards of 1 to 7 rows run one graph (the rows go through one custom op), each request within
    TOLERANCE of its own padded eager forward. The eager forward's own batch-composition noise on the same
    rows is printed beside (what the tolerance is checked against: docs/compile.md), and held to the
    contract's derived tolerance (docs/equality.md)."""
    requests = _packed_requests(tiny_target_dir)
    worst: dict[str, float] = {}
    for group in (requests[:1], requests[1:3], requests):
        for request, got in zip(group, inductor_engine.generate_packed(group, kind="eagle3")):
            report = packing.compare(got, eager_engine.generate_batch(*request), request[1])
            assert packing.violations(report, FP32) == [], report
            _worst(worst, report)
    assert inductor_engine.compile_report.recompiles == 0
    noise: dict[str, float] = {}
    for request in requests:
        for key, value in _row_noise(eager_engine, request).items():
            noise[key] = max(noise.get(key, 0.0), value)
    print("\ncompiled and packed vs eager, float32, worst:", {k: f"{v:.2g}" for k, v in sorted(worst.items())})
    print("eager rows alone vs in their batch, worst:", {k: f"{v:.2g}" for k, v in sorted(noise.items())})


def test_a_new_shape_class_recompiles_once_and_is_counted(plumbing_engine, eager_engine, caplog):
    """Sequences of one token lie outside the warm-up classes: the first compiles (logged at INFO, counted
    in the metrics), the next of another batch size reuses that graph."""
    before = plumbing_engine.compile_report.recompiles
    with caplog.at_level(logging.INFO, logger="spec_serve.engines.compiled"), _propagating():
        for rows in (2, 3):
            ids = torch.randint(4, 512, (rows, 1), generator=torch.Generator().manual_seed(rows))
            attn = loss = torch.ones_like(ids)
            got = plumbing_engine.generate_batch(ids, attn, loss, kind="dspark")
            assert mismatch(got, eager_engine.generate_batch(ids, attn, loss, "dspark")) is None
    assert plumbing_engine.compile_report.recompiles == before + 1
    assert _metrics(plumbing_engine).get_sample_value("spec_serve_worker_compile_recompiles_total") == before + 1
    assert _metrics(plumbing_engine).get_sample_value("spec_serve_worker_compile_seconds_total",
                                                      {"phase": "recompile"}) > 0
    lines = [r.getMessage() for r in caplog.records if "compile.recompiled" in r.getMessage()]
    assert len(lines) == 1 and "shape='[2, 1]'" in lines[0], lines
    if AOT_EAGER_UNSAVED is None:  # the guard of the saved classes that refused, in dynamo's words
        reason = plumbing_engine.compile_report.recompile_reason
        assert reason and reason != "unknown" and f"reason={reason!r}" in lines[0], lines


def test_no_compiler_serves_eager_with_one_warning(one_thread, tiny_target_dir, tiny_vocab_mapping, eager_engine,
                                                   monkeypatch, caplog):
    """Without a C++ compiler (Inductor's CPU code needs one) the engine says so once and serves eager."""
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with caplog.at_level(logging.WARNING, logger="spec_serve.engines.compiled"), _propagating():
        engine = HFTarget(tiny_target_dir, compile=True)
    engine.set_vocab_mapping(*tiny_vocab_mapping)
    report = engine.compile_report
    assert not report.active and "needs a C++ compiler" in report.reason and "/nonexistent/g++" in report.reason
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "compile.failed" in warnings[0].getMessage()
    batch = _batches(tiny_target_dir)[0]
    assert mismatch(engine.generate_batch(*batch), eager_engine.generate_batch(*batch)) is None


@pytest.mark.parametrize("when", ["load", "recompile"])
def test_a_failed_compile_falls_back_to_eager(when, one_thread, tiny_target_dir, tiny_vocab_mapping, eager_engine,
                                              monkeypatch, caplog):
    """A compile that fails (injected in the backend's place, so dynamo reports it as it reports any backend
    failure), at load or on a later recompile: one WARNING naming the reason, the layers back to eager,
    and the forward that met it answered by eager (bit-equal to the eager engine)."""
    monkeypatch.setenv(compiled.TEST_BACKEND_ENV, "eager")
    monkeypatch.setenv(compiled.TEST_CLASSES_ENV, "rows")  # one class: a one-row batch is a recompile
    monkeypatch.setenv(compiled.TEST_FAULT_ENV, when)
    with caplog.at_level(logging.WARNING, logger="spec_serve.engines.compiled"), _propagating():
        engine = HFTarget(tiny_target_dir, compile=True)
        engine.set_vocab_mapping(*tiny_vocab_mapping)
        assert engine.compile_report.active == (when == "recompile")
        batch = _batches(tiny_target_dir)[2]  # one row: outside the one warm-up class
        got = engine.generate_batch(*batch)
    report = engine.compile_report
    assert not report.active and f"a compile failed at {when} (SPEC_SERVE_TEST_COMPILE_FAULT)" in report.reason
    assert [r.getMessage().split()[0] for r in caplog.records if r.levelno >= logging.WARNING] == ["compile.failed"]
    assert not any("forward" in layer.__dict__ for layer in engine._layers)
    assert mismatch(got, eager_engine.generate_batch(*batch)) is None
    exported = _metrics(engine)
    assert exported.get_sample_value("spec_serve_worker_compiled") == 0
    assert exported.get_sample_value("spec_serve_worker_compile_fallbacks_total") == 1


def test_compiled_worker_equals_compiled_colocated_bit_for_bit(inductor_engine, inductor_cache, tiny_target_dir,
                                                               tiny_vocab_mapping, tmp_path):
    """A real worker started with --packing --compile on the colocated engine's cache (--compile-cache: a worker
    restarted, or started beside a trainer that compiled): it loaded the classes the engine saved whole, traced and
    compiled nothing, and its answers to packed requests equal the compiled colocated engine's bit for bit, every
    kind; it logged its compile at INFO and exported it."""
    args = ["--device", "cpu", "--compile-cache", str(inductor_cache)]
    env = {compiled.TEST_CLASSES_ENV: INDUCTOR_CLASSES}
    log, metrics = _worker_matches_colocated(inductor_engine, tiny_target_dir, tiny_vocab_mapping,
                                             _batches(tiny_target_dir), args, tmp_path, env=env, padded=False)
    assert f"cache={inductor_cache}" in log and "manifest=True" in log, log
    assert re.search(r"INFO \S+ compile\.done .*graphs=0 loaded=2 .*phases=trace:0,", log), log
    assert metrics["spec_serve_worker_compiled"] == 1 and metrics["spec_serve_worker_compile_recompiles_total"] == 0
    assert metrics["spec_serve_worker_compile_graphs_total"] == 0
    assert metrics["spec_serve_worker_compile_classes_loaded_total"] == 2


def test_bench_compiled_scenario_verifies_every_batch(inductor_engine, inductor_cache, tiny_target_dir, tmp_path):
    """``spec-serve bench``'s compiled worker scenario, on this module's saved classes (the bench's worker and its
    colocated compiled engine load them whole, as a restarted worker does: Inductor's C++ is built once per run,
    by ``inductor_engine``): every timed batch within compiled.TOLERANCE of the colocated eager forward, the
    eager forward's own noise on the same rows beside it, bit-equal to the colocated compiled forward, flips
    within the bound derived per batch. One-row batches: the class the Inductor engine saved for the probe."""
    out = tmp_path / "bench.json"
    # An engine's compile_cache is process-wide (compiled.cache_dir_from): name this module's cache explicitly.
    env = {**os.environ, "OMP_NUM_THREADS": "1", compiled.TEST_CLASSES_ENV: "row",
           compiled.CACHE_ENV: str(inductor_cache)}
    proc = zygote.run(["-m", "spec_serve.tools.bench", "--target", str(tiny_target_dir), "--only",
                       "samehost_1w_compiled", "--steps", "2", "--warmup", "1", "--batch", "1", "--seq", "32",
                       "--lengths", "full", "--repeat", "2", "--json", str(out)], env, timeout=600, nested=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figure = json.loads(out.read_text())["figures"]["samehost_1w_compiled"]
    # Two rounds of 2 timed batches: the counts cover both rounds.
    assert figure["verified"] == "4/4" and "status" not in figure and figure["plane_replies"] == 3, figure
    assert figure["tolerance"]["hidden_rel_norm"] == 1e-5 and "aux_hidden_states.rel_norm" in figure["noise"]
    assert 0 < figure["worst"]["aux_hidden_states.rel_norm"] <= 1e-5, figure  # compiled: not eager's bits
    assert figure["bit_equal_compiled"] == "4/4" and "position_mask" in figure["flip_bound"], figure
    assert "the eager forward's own noise on the same rows" in proc.stdout


def _worker_matches_colocated(engine, target, mapping, batches, worker_args, log_dir, env=None,
                              padded=True) -> tuple[str, dict]:
    """Serve ``target`` from one worker with ``worker_args --packing --compile`` (and ``env``) and check its
    answers to ``batches`` (packed) and, if ``padded``, to a left-padded batch (served padded) against
    ``engine``'s, bit for bit, for every kind (compact expanded on the client, as a client does); returns the
    worker's log and the compile samples of its /metrics ({'name{label="value"}': value})."""
    weight = lm_head_slice(engine.get_output_embeddings().weight, mapping[0])
    left = [t.clone() for t in batches[0]]
    left[1][0, :5] = 0
    left[2][0, :5] = 0
    requests = [(b, True) for b in batches] + ([(tuple(left), False)] if padded else [])
    port = free_port()
    args = [*worker_args, "--packing", "--compile", "--http-port", str(port)]
    with local_cluster(target, workers=1, worker_args=args, env=env, log_dir=log_dir, ready_timeout=900) as cluster:
        with RemoteTargetModel(cluster.frontend, prefetch_depth=1, timeout=300) as client, \
                RemoteTargetModel(cluster.frontend, prefetch_depth=1, timeout=300, compact=True) as compact:
            for c in (client, compact):
                c.set_vocab_mapping(*mapping)
            for i, (batch, packed) in enumerate(requests):
                want = {kind: (engine.generate_packed([batch], kind)[0] if packed
                               else engine.generate_batch(*batch, kind=kind)) for kind in KINDS}
                for kind in ("eagle3", "dspark"):
                    assert mismatch(client.generate_batch(*batch, kind=kind), want[kind]) is None, (i, kind)
                full = expanded(want["eagle3_compact"], weight, mapping[1], client.device)
                assert mismatch(compact.generate_batch(*batch), full) is None, (i, "compact")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
    log = cluster.log_path("worker0").read_text()
    assert "compile.failed" not in log and "compile.recompiled" not in log, log
    metrics = {s.name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items())) + "}" if s.labels else ""):
               s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name.startswith("spec_serve_worker_compile")}
    return log, metrics


# A Llama of mid size (GQA, head_dim 128 as at 8B), random bf16 weights built on the GPU.
MID_CONFIG = {**LLAMA_8B_CONFIG, "hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 8,
              "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 32000, "bos_token_id": 1,
              "eos_token_id": 2}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_compiled_worker_equals_compiled_colocated_and_bf16_within_tolerance(tmp_path):
    """On the GPU in bf16: a compiled worker (--packing --compile, padded and packed requests, every kind)
    equals the compiled colocated engine bit for bit; compiled answers lie within TOLERANCE[bfloat16] of
    eager, their flips within the bound derived for each batch. Prints the compiled deviation beside the flip
    bound and eager's own batch-composition noise on the same rows."""
    from spec_serve.supervision.vocab import build_vocab_mapping
    from spec_serve.tools.random_target import write_random_init_target

    target = write_random_init_target(tmp_path / "mid", MID_CONFIG)
    engine = HFTarget(target, device="cuda:0", dtype="bfloat16", compile=True)
    eager = HFTarget(target, device="cuda:0", dtype="bfloat16")
    assert engine.compile_report.active, engine.compile_report
    batches = []
    for seed, lengths in enumerate(((512, 300, 77, 512), (1000, 999), (256,), (640, 12, 400))):
        batches.append(padded_batch(list(lengths), MID_CONFIG["vocab_size"], seed))
    mapping = build_vocab_mapping(torch.cat([b[0].flatten() for b in batches]),
                                  torch.cat([b[2].flatten() for b in batches]), MID_CONFIG["vocab_size"], 4096)
    for e in (engine, eager):
        e.set_vocab_mapping(*mapping)
    tolerance = compiled.TOLERANCE[torch.bfloat16]
    worst: dict[str, float] = {}
    noise: dict[str, float] = {}
    lowest = 1.0
    for batch in batches:
        want = eager.generate_batch(*batch)
        report = packing.compare(engine.generate_batch(*batch), want, batch[1].cuda())
        bounds = flip_bound(eager, tuple(t.cuda() for t in batch), tolerance.hidden_rel_norm, reference=want)
        assert packing.violations(report, tolerance, bounds) == [], (report, bounds)
        _worst(worst, report)
        lowest = min(lowest, bounds["position_mask"])
        for key, value in _row_noise(eager, tuple(t.cuda() for t in batch)).items():
            noise[key] = max(noise.get(key, 0.0), value)
    print("\nGPU compiled vs eager, bf16, worst:", {k: f"{v:.3g}" for k, v in sorted(worst.items())})
    print(f"GPU flip bound, derived (lowest over batches): position_mask {lowest:.3g}")
    print("GPU eager rows alone vs in their batch, worst:", {k: f"{v:.3g}" for k, v in sorted(noise.items())})
    print("GPU compile:", engine.compile_report)
    _, metrics = _worker_matches_colocated(engine, target, mapping, batches,
                                           ["--device", "cuda:0", "--dtype", "bfloat16"], tmp_path / "logs")
    assert metrics["spec_serve_worker_compiled"] == 1, metrics
