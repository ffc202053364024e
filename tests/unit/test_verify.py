"""Verification rules leave the output distribution exactly the target's.

The exact distribution of (first emitted tokens) under speculative decoding is compared with
the target's own joint distribution, by Monte Carlo on a tiny vocabulary where both are known,
and the same comparison rejects deliberately wrong rules. `verify_block` follows Sun et al.
2024 (arXiv 2403.10444), Algorithm 2: p_0 = 1, p_i = min(p_{i-1}·M_b(X_i)/M_s(X_i), 1);
h_i = Σ_x max(p_i·M_b(x|X≤i) − M_s(x|X≤i), 0) / (that sum + 1 − p_i) for i < γ, h_γ = p_γ;
τ = the largest i with η_i ≤ h_i (0 if none); the token after the kept prefix is drawn from
M_b(·|X≤γ) when τ = γ, else from norm(max(p_τ·M_b(·|X≤τ) − M_s(·|X≤τ), 0)). vLLM's block kernel
(v1/worker/gpu/spec_decode/rejection_sampler_utils.py:599-629) computes the same h.
The end-to-end version, through the decoder with a real drafter and target, is
test_speculative_lossless.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from dspark.verify import _residual, _sample, verify_block, verify_greedy, verify_standard
from tests.stats import chi_square

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


def exact_joint(p, length):
    """The target's own distribution of its first `length` tokens, from the tables."""
    out = torch.zeros([V] * length, dtype=torch.float64)
    for seq in itertools.product(range(V), repeat=length):
        out[seq] = float(torch.tensor([float(p[seq[:i]][seq[i]]) for i in range(length)], dtype=torch.float64).prod())
    return out


def joint_counts(verify, p, q, trials, length=3, seed=1):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros([V] * length)
    for _ in range(trials):
        counts[emitted_prefix(verify, p, q, gen, length)[0]] += 1
    return counts


# Misreadings of the two rules, each of which the joint test below must reject.
def accept_all(draft, q, p, generator=None):
    return draft.numel(), _sample(p[draft.numel()], generator)


def block_without_lookahead(draft, q, p, generator=None):
    """Block verification with h_i = p_i at every i (the paper's h_i < γ adds the residual mass
    of the next position): accepts more than the target allows."""
    k, weight = draft.numel(), [1.0]
    for i in range(k):
        weight.append(min(weight[-1] * float(p[i][int(draft[i])] / q[i][int(draft[i])]), 1.0))
    accepted = max([i for i in range(1, k + 1) if float(torch.rand((), generator=generator)) <= weight[i]], default=0)
    if accepted == k:
        return k, _sample(p[k], generator)
    r = (weight[accepted] * p[accepted] - q[accepted]).clamp(min=0)
    return accepted, _sample(r / r.sum() if r.sum() > 0 else p[accepted], generator)


def resample_from_target(rule):
    """`rule`, but a rejected position is resampled from the target's distribution instead of
    the residual (the classic bug: the drafted token then counts twice)."""

    def broken(draft, q, p, generator=None):
        n, nxt = rule(draft, q, p, generator)
        return (n, nxt) if n == draft.numel() else (n, _sample(p[n], generator))

    return broken


@pytest.mark.parametrize("verify", [verify_standard, verify_block], ids=["standard", "block"])
def test_joint_of_three_tokens_is_the_targets(verify):
    """Pearson's chi-square of the first three emitted tokens (64 cells) against the exact
    joint: a fixed seed, α = 1e-3."""
    p, q = tables(0)
    stat, df, pval = chi_square(joint_counts(verify, p, q, 6000), exact_joint(p, 3))
    assert pval >= 1e-3, (stat, df, pval)


@pytest.mark.parametrize(
    "broken",
    [accept_all, block_without_lookahead, resample_from_target(verify_block), resample_from_target(verify_standard)],
    ids=["accept_all", "block_without_lookahead", "block_resample_target", "standard_resample_target"],
)
def test_broken_verifiers_are_rejected(broken):
    """The test above has the power to see wrong rules: the same statistic and sample size."""
    p, q = tables(0)
    stat, df, pval = chi_square(joint_counts(broken, p, q, 6000), exact_joint(p, 3))
    assert pval < 1e-6, (stat, df, pval)


def test_residual_is_the_normalised_positive_part():
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.6, 0.2])
    torch.testing.assert_close(_residual(p, q), torch.tensor([1.0, 0.0, 0.0]))


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


def test_a_draft_the_target_rules_out_is_never_kept(monkeypatch):
    """Even when the uniform draw is exactly 0 (torch.rand can return it): a draft with target
    probability 0 has acceptance weight 0 and must be rejected by both rules."""
    p = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.6, 0.2, 0.2]])
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.zeros(()))
    for verify in (verify_standard, verify_block):
        n, nxt = verify(torch.tensor([0]), q, p)
        assert n == 0 and nxt != 0, verify.__name__
