"""Verification rules leave the output distribution exactly the target's.

The exact distribution of (first emitted tokens) under speculative decoding is compared with
the target's own joint distribution, by Monte Carlo on a tiny vocabulary where both are known.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from dspark.verify import verify_block, verify_greedy, verify_standard

V, K = 4, 3


def tables(seed):
    """Context-dependent target p(·|prefix) and draft q(·|prefix) over a 4-token vocabulary."""
    g = torch.Generator().manual_seed(seed)
    p, q = {}, {}
    for n in range(K + 1):
        for prefix in itertools.product(range(V), repeat=n):
            p[prefix] = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
            q[prefix] = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    return p, q


def emitted_prefix(verify, p, q, gen, length=2):
    """One speculative step; return the first `length` tokens it emits (continuing with the
    target if the step emitted fewer)."""
    draft, qs = [], []
    for _ in range(K):
        dist = q[tuple(draft)]
        qs.append(dist)
        draft.append(int(torch.multinomial(dist, 1, generator=gen)))
    tp = torch.stack([p[tuple(draft[:i])] for i in range(K + 1)])
    n, nxt = verify(torch.tensor(draft), torch.stack(qs), tp, gen)
    out = draft[:n] + [nxt]
    while len(out) < length:
        out.append(int(torch.multinomial(p[tuple(out)], 1, generator=gen)))
    return tuple(out[:length]), n


@pytest.mark.parametrize("verify", [verify_standard, verify_block], ids=["standard", "block"])
def test_output_distribution_is_the_targets(verify):
    p, q = tables(0)
    gen = torch.Generator().manual_seed(1)
    trials = 20000
    counts: dict[tuple, int] = {}
    accepted = 0
    for _ in range(trials):
        key, n = emitted_prefix(verify, p, q, gen)
        counts[key] = counts.get(key, 0) + 1
        accepted += n
    for a, b in itertools.product(range(V), repeat=2):
        exact = float(p[()][a] * p[(a,)][b])
        got = counts.get((a, b), 0) / trials
        sd = (exact * (1 - exact) / trials) ** 0.5
        assert abs(got - exact) < 5 * sd + 1e-3, (a, b, got, exact)
    assert 0 < accepted / trials < K  # the draft is neither always rejected nor always accepted


def test_block_accepts_at_least_as_much_as_standard():
    p, q = tables(3)
    mean = {}
    for verify in (verify_standard, verify_block):
        gen = torch.Generator().manual_seed(4)
        mean[verify.__name__] = sum(emitted_prefix(verify, p, q, gen)[1] for _ in range(10000)) / 10000
    assert mean["verify_block"] >= mean["verify_standard"] - 0.01


def test_one_hot_drafts_are_exact_too():
    """Greedy drafting with sampled verification: q is one-hot, still lossless."""
    p, _ = tables(5)
    gen = torch.Generator().manual_seed(6)
    trials, counts = 30000, torch.zeros(V)
    for _ in range(trials):
        draft = torch.tensor([int(torch.argmax(p[()]))])
        qs = torch.nn.functional.one_hot(draft, V).float()
        n, nxt = verify_standard(draft, qs, torch.stack([p[()], p[(int(draft[0]),)]]), gen)
        counts[int(draft[0]) if n else nxt] += 1
    torch.testing.assert_close(counts / trials, p[()], atol=0.015, rtol=0)


def test_greedy():
    logits = torch.tensor([[0.0, 5, 0], [9, 0, 0], [0, 0, 3]])
    assert verify_greedy(torch.tensor([1, 0]), logits) == (2, 2)
    assert verify_greedy(torch.tensor([1, 2]), logits) == (1, 0)
    assert verify_greedy(torch.tensor([0, 2]), logits) == (0, 1)
