"""Hardware-aware prefix scheduler (DSpark paper, Algorithm 1).

Each request r has drafted tokens with confidences c_{r,1..K}; a_{r,j} = Π_{i≤j} c_{r,i} is the
probability that its j-th draft is accepted. Verifying costs batch tokens; the serving engine's
profiled steps-per-second table SPS(tokens) says how fast a step of that size runs. Starting
from one token per request (the anchor is always verified and always yields a token), admit
draft tokens in decreasing a_{r,j} while the expected throughput Θ = E[emitted] · SPS(batch)
increases, and stop at the first admission that does not. Under light load long prefixes are
verified; under heavy load the unlikely suffixes are trimmed.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

import torch


@dataclass
class StepRateTable:
    """Measured steps/s of the target at given verification batch sizes (in tokens)."""

    batch_tokens: list[int]
    steps_per_s: list[float]

    def __post_init__(self) -> None:
        if len(self.batch_tokens) != len(self.steps_per_s) or not self.batch_tokens:
            raise ValueError("batch_tokens and steps_per_s must be non-empty and equally long")
        if any(b <= a for a, b in zip(self.batch_tokens, self.batch_tokens[1:])):
            raise ValueError("batch_tokens must be strictly increasing")

    def __call__(self, tokens: int) -> float:
        xs, ys = self.batch_tokens, self.steps_per_s
        if tokens <= xs[0]:
            return ys[0]
        if tokens >= xs[-1]:
            # Past the table the engine is compute bound: tokens/s stays at its last value.
            return ys[-1] * xs[-1] / tokens
        i = bisect_left(xs, tokens)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    @classmethod
    def flat(cls, steps_per_s: float = 1.0) -> StepRateTable:
        """A table where verifying more tokens is free: the scheduler keeps every draft."""
        return cls([1, 1 << 30], [steps_per_s, steps_per_s])


def schedule_prefixes(confidences: list[torch.Tensor], sps: StepRateTable) -> list[int]:
    """Number of draft tokens to verify for each request."""
    survival = [torch.cumprod(c.float().flatten(), 0) for c in confidences]
    # Sort by survival, ties by position, so each request's admitted drafts stay a prefix.
    cands = sorted(
        ((float(a[j]), j, r) for r, a in enumerate(survival) for j in range(a.numel())),
        key=lambda t: (-t[0], t[1]),
    )
    tokens = len(confidences)
    expected = float(len(confidences))
    best = expected * sps(tokens)
    lengths = [0] * len(confidences)
    for a, _j, r in cands:
        theta = (expected + a) * sps(tokens + 1)
        if theta <= best:
            break
        tokens, expected, best = tokens + 1, expected + a, theta
        lengths[r] += 1
    return lengths
