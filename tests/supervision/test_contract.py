"""The batch-composition contract (docs/equality.md, spec_serve/supervision/tolerance.py).

Each shard is bit-equal to the colocated forward of the same rows in the same composition; the
assembled batch equals the unsharded forward bit for bit where the kernels are batch-invariant, and
lies within the derived tolerance elsewhere. Here: the derivation's figures, the tolerance's verdicts
on made-up differences (so its branch runs on every machine), and the noise this machine's kernels
really give for several compositions, measured against the bounds. Short rows are the case that is
batch-variant on AVX-512 CPUs with MKL: a GEMM of fewer than 8 rows takes another path.
"""

from __future__ import annotations

import math

import pytest
import torch

from cluster_util import assert_contract
from spec_serve.supervision import contract
from spec_serve.supervision.tolerance import Bound, CompositionTolerance, ReferenceLogits, deviation
from spec_serve.tools.tiny import sample_batch
from spec_serve.tools.verify import check_contract, colocated_reference, tolerance_for

U32 = 2.0**-24
TINY = CompositionTolerance.derive(torch.float32, num_layers=8, reduction=256)


def test_the_derivation_gives_its_stated_figures():
    # One stage: two roundings to the output dtype plus sqrt(K) accumulation roundings; 8 stages a layer.
    assert TINY.hidden.rel_norm == pytest.approx(math.sqrt(64) * (2 * U32 + 16 * U32))
    assert TINY.hidden.rel_norm == pytest.approx(8.6e-6, rel=0.01)
    assert TINY.hidden.max_error == pytest.approx(6 * TINY.hidden.rel_norm)
    assert TINY.logits.rel_norm == pytest.approx(math.sqrt(66) * 18 * U32)
    big = CompositionTolerance.derive(torch.bfloat16, num_layers=32, reduction=14336)
    assert big.hidden.rel_norm == pytest.approx(0.125, rel=0.01)
    assert big.hidden.max_error == pytest.approx(0.75, rel=0.01)
    # Finer dtypes and shallower targets get tighter bounds.
    assert Bound.derive(torch.float16, 64, 256).rel_norm < Bound.derive(torch.bfloat16, 64, 256).rel_norm
    assert Bound.derive(torch.float32, 8, 256).rel_norm < TINY.hidden.rel_norm
    with pytest.raises(ValueError, match="no composition tolerance for torch.int64"):
        Bound.derive(torch.int64, 8, 256)


def _batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 4, 8, generator=gen) * 3
    logits = torch.randn(2, 4, 16, generator=gen)
    probs = torch.softmax(logits, -1)
    argmax = torch.zeros(2, 4, dtype=torch.int32)
    argmax[:, :-1] = logits.argmax(-1)[:, 1:]
    return {"aux_hidden_states": hidden, "target_probs": probs, "argmax_ids": argmax,
            "input_ids": torch.arange(8).view(2, 4)}, ReferenceLogits.of(logits)


def test_the_tolerance_accepts_rounding_noise_and_refuses_what_is_more():
    want, logits = _batch()
    assert TINY.violations(want, {k: v.clone() for k, v in want.items()}, logits) == []
    noisy = dict(want, aux_hidden_states=want["aux_hidden_states"] * (1 + 4 * U32),
                 target_probs=want["target_probs"] * (1 + 4 * U32))
    assert TINY.violations(noisy, want, logits) == []
    assert deviation(noisy["aux_hidden_states"], want["aux_hidden_states"])[0] > 0  # really differs
    off = dict(want, aux_hidden_states=want["aux_hidden_states"] + 1e-3)
    assert any(v.startswith("aux_hidden_states: rel_norm") for v in TINY.violations(off, want, logits))
    # The request's own tensors are exact in every composition; probabilities need the logits' scale.
    assert TINY.violations(dict(want, input_ids=want["input_ids"] + 1), want, logits) == [
        "input_ids: differs, and is exact in every composition"]
    assert "needs the reference's logits" in TINY.violations(noisy, want)[0]


def test_an_argmax_may_flip_only_at_a_near_tie():
    want, logits = _batch()
    limit = 2 * TINY.logits.max_error * logits.scale
    flipped = want["argmax_ids"].clone()
    flipped[0, 1] += 1
    clear = ReferenceLogits(logits.scale, torch.full_like(logits.margins, 10 * limit))
    tied = ReferenceLogits(logits.scale, torch.full_like(logits.margins, limit / 2))
    assert "no near-tie" in TINY.violations(dict(want, argmax_ids=flipped), want, clear)[0]
    assert TINY.violations(dict(want, argmax_ids=flipped), want, tied) == []


# Compositions: (rows, seq, shards). A shard of one short row is a GEMM of 2-3 rows: batch-variant on this
# project's AVX-512 CI box with MKL and one thread (not under MKL_CBWR=COMPATIBLE); 24 and 64 tokens were
# invariant there, not on every CPU (BENCHMARKS.md, "Batch composition").
COMPOSITIONS = [(3, 2, 2), (4, 2, 4), (3, 3, 2), (4, 3, 2), (3, 24, 2), (4, 64, 2)]


@pytest.fixture(scope="module")
def engine(colocated_target):
    return colocated_target()


@pytest.mark.parametrize("kind", ["eagle3", "dspark", "eagle3_compact"])
def test_composition_noise_is_within_the_derived_tolerance(engine, tiny_target_dir, kind):
    """Each composition computed colocated both ways (each shard alone, and whole): bit-equal where the
    kernels are batch-invariant, else within the bounds; prints what was measured, to compare with
    BENCHMARKS.md ("Batch composition")."""
    tolerance = tolerance_for(engine)
    assert tolerance == TINY
    variant = []
    for rows, seq, shards in COMPOSITIONS:
        batch = sample_batch(tiny_target_dir, rows, seq, seed=7)
        sharded = colocated_reference(engine, batch, kind, shards=shards)
        check = check_contract(sharded, engine, batch, kind, shards=shards)
        assert check.ok, check.describe()
        if not check.invariant:
            variant.append(f"{rows}x{seq}/{shards}: " + ", ".join(
                f"{n} rel_norm {m.get('rel_norm', 0):.2g} max_error {m.get('max_error', 0):.2g}"
                for n, m in check.deviation.items()))
    bounds = f"rel_norm {tolerance.hidden.rel_norm:.2g} max_error {tolerance.hidden.max_error:.2g}"
    print(f"\n{kind}: {len(variant)} of {len(COMPOSITIONS)} compositions batch-variant on this machine; bounds "
          f"{bounds}\n  " + "\n  ".join(variant))


def test_the_tolerance_refuses_a_row_computed_from_other_tokens(engine, tiny_target_dir):
    """Not loose: a row answered from inputs one token off (requests mixed up, rows attending to each
    other) lies far outside it."""
    batch = sample_batch(tiny_target_dir, 2, 16, seed=5)
    right = engine.generate_batch(*batch, kind="dspark")
    other = batch[0].clone()
    other[1, 3] = (other[1, 3] + 1) % 512
    wrong = {name: t.clone() for name, t in right.items()}
    for name, t in engine.generate_batch(other, *batch[1:], kind="dspark").items():
        if name != "input_ids":
            wrong[name][1] = t[1]
    rel_norm = deviation(wrong["target_last_hidden_states"], right["target_last_hidden_states"])[0]
    assert rel_norm > 1000 * TINY.hidden.rel_norm
    assert len(TINY.violations(wrong, right)) == 4  # both measures of both hidden-state tensors


def test_the_helper_names_the_shard_that_differs(engine, tiny_target_dir):
    batch = sample_batch(tiny_target_dir, 4, 8, seed=2)
    got = colocated_reference(engine, batch, "dspark", shards=2)
    got["target_last_hidden_states"][3, 0, 0] += 1.0
    with pytest.raises(AssertionError, match="a shard differs from the colocated forward of its rows: "
                                             "target_last_hidden_states"):
        assert_contract(got, engine, batch, "dspark", shards=2)


def test_compact_expansion_does_not_depend_on_where_its_operands_lie(engine, tiny_target_dir, tiny_vocab_mapping):
    """A client expands compact replies on tensors that are views of received frames (8 bytes off a 64-byte
    boundary); MKL's GEMM of a few rows gives other low bits there. The expansion equals the colocated one
    (fresh, aligned tensors) bit for bit wherever its operands lie."""
    from spec_serve.supervision.eagle3 import expand_compact, lm_head_slice

    compact = engine.generate_batch(*sample_batch(tiny_target_dir, 3, 2, seed=3), kind="eagle3_compact")
    weight = lm_head_slice(engine.get_output_embeddings().weight, tiny_vocab_mapping[0])
    want = expand_compact(compact, weight, tiny_vocab_mapping[1])

    def off_boundary(t: torch.Tensor, floats: int) -> torch.Tensor:
        buffer = torch.empty(t.numel() + 16, dtype=t.dtype)
        view = buffer[floats : floats + t.numel()].view(t.shape)
        view.copy_(t)
        return view

    for floats in (1, 2, 4, 8):
        got = expand_compact(dict(compact, last_hidden_states=off_boundary(compact["last_hidden_states"], floats)),
                             off_boundary(weight, floats), tiny_vocab_mapping[1])
        assert all(torch.equal(got[k], want[k]) for k in want), floats


@pytest.mark.parametrize("rows, expected", [
    ([[1, 1, 1, 1], [1, 1, 0, 0]], True),  # full, and real tokens then padding
    ([[0, 0, 0, 0]], True),  # a row of padding only
    ([[0, 1, 1, 1]], False),  # left-padded
    ([[1, 0, 1, 0]], False),  # a hole
    ([[1, 1, 0, 0], [0, 0, 1, 1]], False),  # one row left-padded is enough
])
def test_right_padded_means_every_row_real_then_padding(rows, expected):
    mask = torch.tensor(rows)
    assert contract.right_padded(mask) is expected
    assert contract.right_padded(mask.bool()) is expected
