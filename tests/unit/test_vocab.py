from __future__ import annotations

import pytest
import torch

from dspark.checkpoint import load_drafter, save_drafter
from dspark.vocab import build_vocab_mapping, check_mapping, token_frequencies
from tests.helpers import make_drafter, random_batch


def test_mapping_is_top_n_and_round_trips():
    counts = torch.tensor([5, 0, 9, 9, 1, 0, 7, 3])
    d2t, t2d = build_vocab_mapping(counts, 4)
    target = torch.arange(4) + d2t
    assert target.tolist() == [0, 2, 3, 6]  # the four most frequent, in id order
    assert t2d.nonzero().squeeze(-1).tolist() == target.tolist()
    check_mapping(d2t, t2d)
    # ties resolve to the lower id, and forced tokens are always kept
    d2t, t2d = build_vocab_mapping(torch.tensor([1, 1, 1, 1]), 2, always=[3])
    assert (torch.arange(2) + d2t).tolist() == [0, 3]


def test_check_mapping_rejects_inconsistent():
    d2t, t2d = build_vocab_mapping(torch.arange(10), 4)
    t2d = t2d.clone()
    t2d[0] = True
    with pytest.raises(ValueError):
        check_mapping(d2t, t2d)


def test_frequencies_count_only_loss_masked():
    ids = torch.tensor([1, 2, 2, 3])
    mask = torch.tensor([False, True, True, False])
    assert token_frequencies([(ids, mask)], 5).tolist() == [0, 0, 2, 0, 0]


def test_reduced_vocab_checkpoint_round_trip(tiny_target, tmp_path):
    """d2t/t2d and the reduced head survive save/load, and logits are unchanged."""
    m = make_drafter(tiny_target, draft_vocab_size=1000, seed=3)
    save_drafter(m, tmp_path / "d")
    back = load_drafter(tmp_path / "d", tiny_target).eval()
    assert torch.equal(back.d2t, m.d2t) and torch.equal(back.t2d, m.t2d)
    check_mapping(back.d2t, back.t2d)
    assert torch.equal(back.lm_head.weight, m.verifier_lm_head.weight[m.draft_to_target_ids()])
    batch = random_batch(m.config)
    a = m.sample_anchors(batch, 4, torch.Generator().manual_seed(0))
    torch.testing.assert_close(back(batch, a).logits, m(batch, a).logits)
