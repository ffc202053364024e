"""Verification rules: which drafted tokens the target accepts, and what it emits next.

Each returns `(n_accepted, next_token)`: the first `n_accepted` drafts are kept and the target
contributes `next_token` (a correction or, when everything was accepted, the bonus token).
All three leave the output distribution exactly the target's:
- greedy: accept while the draft equals the target's argmax (temperature 0);
- standard (Leviathan et al., 2023): accept d_i with probability min(1, p_i(d)/q_i(d)); on
  rejection sample from norm(max(p_i − q_i, 0));
- block (Sun et al., 2024, "Block verification accelerates speculative decoding"): judge the
  block jointly, accepting the longest prefix whose weight h_i passes, which accepts at least
  as many tokens in expectation as standard verification.
`draft_probs[i]` is the distribution d_i was sampled from (one-hot for greedy drafting);
`target_probs` has one more row than there are drafts.
"""

from __future__ import annotations

import torch


def verify_greedy(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    best = target_logits.argmax(-1)
    n = 0
    while n < draft.numel() and int(draft[n]) == int(best[n]):
        n += 1
    return n, int(best[n])


def _sample(p: torch.Tensor, generator) -> int:
    return int(torch.multinomial(p, 1, generator=generator))


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    r = (p - q).clamp(min=0)
    total = r.sum()
    # r = 0 only when p == q, where rejection has probability 0; fall back to p for safety.
    return r / total if total > 0 else p


def verify_standard(draft, draft_probs, target_probs, generator=None) -> tuple[int, int]:
    for i in range(draft.numel()):
        d = int(draft[i])
        p, q = target_probs[i], draft_probs[i]
        u = float(torch.rand((), generator=generator))
        if q[d] <= 0 or u >= min(1.0, float(p[d] / q[d])):
            return i, _sample(_residual(p, q), generator)
    return draft.numel(), _sample(target_probs[draft.numel()], generator)


def verify_block(draft, draft_probs, target_probs, generator=None) -> tuple[int, int]:
    k = draft.numel()
    if k == 0:
        return 0, _sample(target_probs[0], generator)
    # weight[i] = p_i in the paper: min(weight[i-1] * M_b(X_i)/M_s(X_i), 1), weight[0] = 1.
    weight = [1.0]
    for i in range(k):
        d = int(draft[i])
        ratio = float(target_probs[i][d] / draft_probs[i][d]) if draft_probs[i][d] > 0 else 0.0
        weight.append(min(weight[-1] * ratio, 1.0))
    accepted = 0
    for i in range(1, k + 1):
        if i < k:
            mass = float((weight[i] * target_probs[i] - draft_probs[i]).clamp(min=0).sum())
            denom = mass + 1.0 - weight[i]
            h = mass / denom if denom > 0 else 1.0
        else:
            h = weight[k]
        # η_i ≤ h_i in the paper, η continuous; torch.rand is uniform on [0, 1) and can be 0,
        # so `<` keeps P(pass) = h exactly (with `<=`, h_i = 0 would still pass when η = 0).
        if float(torch.rand((), generator=generator)) < h:
            accepted = i
    if accepted == k:
        return k, _sample(target_probs[k], generator)
    p, q = weight[accepted] * target_probs[accepted], draft_probs[accepted]
    r = (p - q).clamp(min=0)
    return accepted, _sample(r / r.sum() if r.sum() > 0 else target_probs[accepted], generator)
