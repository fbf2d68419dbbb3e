"""Draft vocabulary: most frequent target ids, ties by id, zero-count fill, the d2t / t2d maps."""

from __future__ import annotations

import pytest
import torch

from vatspec.drafters.vocab import build_draft_vocab, check_draft_vocab, target_ids


def reference_ids(counts: list[int], size: int) -> list[int]:
    """Independent reference: rank by (-count, id), keep `size`, sort ascending."""
    ranked = sorted(range(len(counts)), key=lambda i: (-counts[i], i))
    return sorted(ranked[: min(size, len(counts))])


def test_hand_example():
    counts = torch.tensor([0, 5, 2, 5, 0, 1])
    d2t, t2d = build_draft_vocab(counts, 3)
    # ids 1 and 3 (count 5), then 2 (count 2) -> [1, 2, 3]
    assert d2t.tolist() == [1, 1, 1]
    assert t2d.tolist() == [False, True, True, True, False, False]
    assert d2t.dtype == torch.long and t2d.dtype == torch.bool


def test_ties_go_to_the_lower_id():
    counts = torch.tensor([3, 7, 7, 7, 3])
    d2t, _ = build_draft_vocab(counts, 2)
    assert target_ids(d2t).tolist() == [1, 2]  # three ids tie at 7: the two lowest win


def test_zero_counts_fill_up_by_id():
    counts = torch.tensor([0, 0, 4, 0, 9, 0])
    d2t, t2d = build_draft_vocab(counts, 4)
    # seen: 4, 2; then zero-count ids in id order: 0, 1
    assert target_ids(d2t).tolist() == [0, 1, 2, 4]
    assert t2d.sum().item() == 4


def test_size_is_capped_by_the_vocabulary():
    d2t, t2d = build_draft_vocab(torch.tensor([1, 2, 3]), 32000)
    assert d2t.tolist() == [0, 0, 0] and t2d.all()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_reference_on_random_counts(seed: int):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 4, (200,), generator=g)  # many ties and zeros
    for size in (1, 17, 120, 200, 500):
        d2t, t2d = build_draft_vocab(counts, size)
        want = reference_ids(counts.tolist(), size)
        assert target_ids(d2t).tolist() == want
        assert t2d.nonzero().squeeze(-1).tolist() == want
        check_draft_vocab(d2t, t2d)


def test_bad_inputs_fail():
    with pytest.raises(ValueError, match="integer"):
        build_draft_vocab(torch.tensor([1.0, 2.0]), 1)
    with pytest.raises(ValueError, match=">= 0"):
        build_draft_vocab(torch.tensor([1, -1]), 1)
    with pytest.raises(ValueError, match="size"):
        build_draft_vocab(torch.tensor([1, 1]), 0)
    with pytest.raises(ValueError, match=r"\[V\]"):
        build_draft_vocab(torch.ones(2, 2, dtype=torch.long), 1)


def test_check_draft_vocab_catches_mismatch():
    d2t, t2d = build_draft_vocab(torch.tensor([5, 0, 3, 1]), 2)  # ids [0, 2]
    t2d_bad = t2d.clone()
    t2d_bad[1] = True
    with pytest.raises(ValueError, match="t2d"):
        check_draft_vocab(d2t, t2d_bad)
    with pytest.raises(ValueError, match="ascending"):
        check_draft_vocab(torch.tensor([2, -1]), torch.tensor([False, True, True, False]))
