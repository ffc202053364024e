"""Sequential Temperature Scaling of the confidence head (DSpark paper, §calibration).

The scheduler multiplies confidences along a block (Π_{i≤k} c_i = P(first k drafts survive)), so
calibrating each c_k alone is not enough: errors compound. STS goes left to right; at position
k it fixes T_1..T_{k−1} and grid-searches the T_k that minimises the expected calibration
error of the cumulative product against the observed survival of the first k drafts.
"""

from __future__ import annotations

import torch

from .losses import expected_calibration_error

DEFAULT_GRID = torch.cat([torch.linspace(0.25, 1.0, 16), torch.linspace(1.05, 4.0, 60)])


def sequential_temperature_scaling(
    logits: torch.Tensor,
    accepted: torch.Tensor,
    valid: torch.Tensor | None = None,
    grid: torch.Tensor = DEFAULT_GRID,
    n_bins: int = 15,
) -> tuple[list[float], list[float], list[float]]:
    """Temperatures `[K]` for confidence logits `[M, K]` and per-slot acceptance `[M, K]`.

    `accepted` may be soft (the analytic acceptance probability c*) or hard (0/1 outcomes);
    `valid` masks blocks that end early. Returns (temperatures, ECE before, ECE after) per slot.
    """
    logits, accepted = logits.float(), accepted.float()
    valid = torch.ones_like(accepted, dtype=torch.bool) if valid is None else valid.bool()
    m, k = logits.shape
    survive = torch.cumprod(accepted, dim=1)
    temps: list[float] = []
    before, after = [], []
    prefix = torch.ones(m)
    raw_prefix = torch.ones(m)
    for j in range(k):
        rows = valid[:, : j + 1].all(dim=1)
        raw_prefix = raw_prefix * torch.sigmoid(logits[:, j])
        before.append(float(expected_calibration_error(raw_prefix[rows], survive[rows, j], n_bins)))
        if not bool(rows.any()):
            temps.append(1.0)
            after.append(before[-1])
            prefix = prefix * torch.sigmoid(logits[:, j])
            continue
        errs = torch.stack(
            [
                expected_calibration_error((prefix * torch.sigmoid(logits[:, j] / t))[rows], survive[rows, j], n_bins)
                for t in grid
            ]
        )
        best = int(torch.argmin(errs))
        temps.append(float(grid[best]))
        after.append(float(errs[best]))
        prefix = prefix * torch.sigmoid(logits[:, j] / grid[best])
    return temps, before, after


def survival_ece(
    logits: torch.Tensor,
    accepted: torch.Tensor,
    valid: torch.Tensor | None = None,
    temperatures: list[float] | None = None,
    n_bins: int = 15,
) -> list[float]:
    """Per position k, the expected calibration error of the predicted survival of the first k
    drafts (the product of the confidences up to k, each at its temperature; None: 1) against
    the observed survival: what `sequential_temperature_scaling` minimises, measured on other
    data (the blocks it was not fitted on)."""
    logits, accepted = logits.float(), accepted.float()
    valid = torch.ones_like(accepted, dtype=torch.bool) if valid is None else valid.bool()
    m, k = logits.shape
    temps = temperatures if temperatures is not None else [1.0] * k
    survive = torch.cumprod(accepted, dim=1)
    prefix, out = torch.ones(m), []
    for j in range(k):
        rows = valid[:, : j + 1].all(dim=1)
        prefix = prefix * torch.sigmoid(logits[:, j] / temps[j])
        out.append(float(expected_calibration_error(prefix[rows], survive[rows, j], n_bins)))
    return out
