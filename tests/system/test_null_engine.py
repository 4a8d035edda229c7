"""The transport benches' null engine (spec_serve/tools/null_engine.py): its replies are the ready tensors
the benches verify against, and what it holds is bounded by its largest reply, not by how many row lengths
it has met (a trainer's batches meet a new one nearly every batch)."""

from __future__ import annotations

import torch

from spec_serve.supervision import fp8
from spec_serve.supervision.contract import FP8_TENSORS
from spec_serve.tools import null_engine
from spec_serve.tools.null_engine import HIDDEN, NullEngine, null_tensors

SHAPES = [(1, 8), (2, 16), (1, 4), (2, 15), (1, 31)]


def _held_bytes(engine: NullEngine) -> int:
    return sum(t.numel() * t.element_size() for t in engine._constants._flat.values())


def _reply_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def test_replies_equal_the_ready_tensors_and_memory_stays_that_of_the_largest_reply():
    for kind in ("eagle3", "eagle3_compact"):
        engine = NullEngine()
        for rows, seq in SHAPES:
            got = engine.generate_batch(torch.zeros(rows, seq, dtype=torch.int64), None, None, kind)
            want = null_tensors(rows, seq, kind)
            assert got.keys() == want.keys()
            assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)
        assert _held_bytes(engine) == _reply_bytes(null_tensors(1, 32, kind))  # 32 tokens: (2, 16) and (1, 31)


def test_quantize_once_answers_what_quantize_reply_would(monkeypatch):
    real = fp8.quantize_reply
    monkeypatch.setattr(fp8, "quantize_reply", real)  # restored after the test
    null_engine.quantize_once()
    for rows, seq in SHAPES:
        tensors = null_tensors(rows, seq, "eagle3_compact")
        got, want = fp8.quantize_reply(tensors, FP8_TENSORS, HIDDEN), real(tensors, FP8_TENSORS, HIDDEN)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)
