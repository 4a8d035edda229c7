"""Draft-vocab mapping builder and the d2t checkpoint form."""

from __future__ import annotations

import pytest
import torch

from spec_serve.supervision.vocab import build_vocab_mapping, from_d2t, mask_from_selected, to_d2t

INPUT_IDS = torch.tensor([[9, 9, 9, 7, 7, 5, 5, 8, 6, 6, 6, 6]])
# Under the loss mask: 9 x3, 7 x2, 5 x2, 8 x1; token 6 occurs only where the mask is 0.
LOSS_MASK = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0]])


@pytest.mark.parametrize(
    "draft_vocab_size, expected",
    [
        (1, [9]),
        (2, [5, 9]),  # 5 and 7 tie at 2: the lower id wins
        (3, [5, 7, 9]),
        (4, [5, 7, 8, 9]),
        (6, [0, 1, 5, 7, 8, 9]),  # then never-seen ids, ascending
    ],
)
def test_frequency_under_loss_mask_ties_to_lower_id(draft_vocab_size, expected):
    selected, mask = build_vocab_mapping(INPUT_IDS, LOSS_MASK, 12, draft_vocab_size)
    assert selected.tolist() == expected
    assert torch.equal(mask.nonzero().flatten(), selected)


def test_specials_come_first():
    input_ids, loss_mask = INPUT_IDS, LOSS_MASK
    selected, mask = build_vocab_mapping(input_ids, loss_mask, 12, 7, special_token_ids=(11, 2, 11))
    # Specials 11 and 2 (deduplicated) first, then 9, 5, 7, 8 by frequency, then unused 0; sorted.
    assert selected.tolist() == [0, 2, 5, 7, 8, 9, 11]
    assert selected.dtype == torch.int64 and mask.dtype == torch.bool and mask.shape == (12,)
    assert torch.equal(mask.nonzero().flatten(), selected)
    # Without a loss mask every token counts: 6 (x4) now wins.
    assert build_vocab_mapping(input_ids, None, 12, 1)[0].tolist() == [6]
    # Nothing seen at all: the lowest ids.
    assert build_vocab_mapping(input_ids, torch.zeros_like(loss_mask), 12, 3)[0].tolist() == [0, 1, 2]


def test_rejects_bad_arguments():
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_vocab_mapping(ids, None, 4, 5)
    with pytest.raises(ValueError, match="token ids"):
        build_vocab_mapping(ids, None, 3, 2)
    with pytest.raises(ValueError, match="special"):
        build_vocab_mapping(ids, None, 4, 1, special_token_ids=(0, 1))
    with pytest.raises(ValueError, match="shape"):
        build_vocab_mapping(ids, torch.ones(1, 2), 4, 2)


def test_d2t_round_trip():
    input_ids = torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(0))
    selected, mask = build_vocab_mapping(input_ids, None, 1000, 100)
    d2t = to_d2t(selected)
    assert bool((d2t >= 0).all()) and bool((d2t[1:] >= d2t[:-1]).all())  # sorted ids: non-negative, non-decreasing
    assert torch.equal(from_d2t(d2t), selected)
    assert torch.equal(mask_from_selected(selected, 1000), mask)
