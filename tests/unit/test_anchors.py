from __future__ import annotations

import torch

from dspark.anchors import eligible_anchors, sample_anchors


def brute_force_eligible(mask, docs, g, shift):
    t = len(mask)
    out = []
    for p in range(t):
        last = p + g - 1 + shift
        ok = (
            p + 1 < t
            and last < t
            and bool(mask[p + 1])
            and all(int(docs[i]) == int(docs[p]) for i in range(p, last + 1))
        )
        out.append(ok)
    return out


def test_eligibility_matches_definition():
    gen = torch.Generator().manual_seed(0)
    for shift in (0, 1):
        docs = torch.tensor([0] * 13 + [1] * 9 + [2] * 4)
        mask = torch.rand(len(docs), generator=gen) > 0.3
        got = eligible_anchors(mask, docs, 4, shift).tolist()
        assert got == brute_force_eligible(mask.tolist(), docs, 4, shift)


def test_sampling_is_distinct_bounded_and_per_sample():
    docs = torch.tensor([0] * 50 + [1] * 50)
    mask = torch.ones(100, dtype=torch.bool)
    a = sample_anchors(mask, docs, 8, 10, 1, torch.Generator().manual_seed(1))
    assert a.numel() == 20 and a.unique().numel() == 20
    assert ((docs[a] == 0).sum(), (docs[a] == 1).sum()) == (10, 10)
    assert bool(eligible_anchors(mask, docs, 8, 1)[a].all())
    assert torch.equal(a, torch.sort(a).values)


def test_sampling_is_uniform():
    docs = torch.zeros(30, dtype=torch.long)
    mask = torch.ones(30, dtype=torch.bool)
    gen = torch.Generator().manual_seed(2)
    counts = torch.zeros(30)
    for _ in range(3000):
        counts[sample_anchors(mask, docs, 4, 3, 1, gen)] += 1
    ok = eligible_anchors(mask, docs, 4, 1)
    assert counts[~ok].sum() == 0
    expected = 3000 * 3 / int(ok.sum())
    assert (counts[ok] - expected).abs().max() < 0.2 * expected
