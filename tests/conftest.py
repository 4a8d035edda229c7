"""Shared fixtures: one tiny random Llama target per test session, and colocated engines on it."""

from __future__ import annotations

import os

import pytest

# On a CPU the number of math threads is part of a forward's composition: MKL splits a GEMM of a few rows
# between threads differently, and the low bits follow (docs/equality.md). The workers a test starts run
# with OMP_NUM_THREADS (spec_serve.tools.launch: 1 unless set), so this process's colocated references do
# too. Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Keep a small draft vocab so EAGLE-3 batches exercise index_select and the t2d mask.
TINY_DRAFT_VOCAB = 256


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    """Path of a tiny random ``LlamaForCausalLM`` (8 layers, H=128, V=512) built once per session."""
    from spec_serve.tools.tiny import make_tiny_target

    return make_tiny_target(tmp_path_factory.mktemp("targets") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_vocab_mapping(tiny_target_dir):
    """A deterministic ``(selected_token_ids, selected_token_mask)`` for the tiny target."""
    from spec_serve.supervision.vocab import build_vocab_mapping
    from spec_serve.tools.tiny import sample_batch

    input_ids, _, loss_mask = sample_batch(tiny_target_dir, batch=8, seq=64, seed=0)
    return build_vocab_mapping(input_ids, loss_mask, 512, TINY_DRAFT_VOCAB, special_token_ids=(0, 1, 2, 3))


@pytest.fixture(scope="session")
def colocated_target(tiny_target_dir, tiny_vocab_mapping):
    """Factory: ``colocated_target(**HFTarget_kwargs)`` -> a fresh in-process ``HFTarget`` on the tiny
    target with ``tiny_vocab_mapping`` set (pass ``vocab_mapping=None`` to leave it unset)."""
    from spec_serve.engines.hf import HFTarget

    def make(vocab_mapping=tiny_vocab_mapping, **kwargs):
        engine = HFTarget(tiny_target_dir, **kwargs)
        if vocab_mapping is not None:
            engine.set_vocab_mapping(*vocab_mapping)
        return engine

    return make


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run tests marked slow (long load and soak runs); or set SPEC_SERVE_RUN_SLOW=1")


def pytest_collection_modifyitems(config, items):
    import os

    if config.getoption("--run-slow") or os.environ.get("SPEC_SERVE_RUN_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow or SPEC_SERVE_RUN_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    """A worker a test SIGKILLs leaves its same-host plane segments for the next worker on the host to reap
    (docs/ARCHITECTURE.md); after the last test no worker follows, so reap them here: a test run leaves no
    /dev/shm file of a dead test worker behind."""
    from spec_serve.paths.plane import shm

    reaped = shm.reap()
    if reaped:
        print(f"\nreaped {len(reaped)} same-host plane segment(s) of test workers killed without a clean stop")
