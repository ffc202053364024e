"""Goodness of fit for the losslessness tests: an empirical distribution against an exact one
known in advance (no parameter estimated from the sample)."""

from __future__ import annotations

import torch


def chi_square(counts: torch.Tensor, exact: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Pearson's statistic, its degrees of freedom and p-value of `counts` (any shape) against
    the probabilities `exact` (same shape). Cells expected fewer than `min_expected` times are
    pooled into one, where the chi-square approximation would not hold. The p-value is the
    chi-square survival function, Q(df/2, stat/2) (torch's regularised upper incomplete gamma)."""
    n = float(counts.sum())
    e, c = exact.flatten().double() * n, counts.flatten().double()
    small = e < min_expected
    e = torch.cat([e[~small], e[small].sum()[None]])
    c = torch.cat([c[~small], c[small].sum()[None]])
    if float(e[-1]) == 0.0:  # nothing pooled
        assert float(c[-1]) == 0.0, "counts where the exact probability is 0"
        e, c = e[:-1], c[:-1]
    stat, df = float(((c - e) ** 2 / e).sum()), e.numel() - 1
    p = float(
        torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )
    return stat, df, p
