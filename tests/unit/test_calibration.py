from __future__ import annotations

import torch

from dspark.calibration import sequential_temperature_scaling


def test_recovers_overconfidence_and_lowers_ece():
    """Outcomes drawn from σ(z); the head reports 2.5·z. STS must find T ≈ 2.5 at slot 1 and
    reduce the ECE of the cumulative products at every slot."""
    g = torch.Generator().manual_seed(0)
    m, k = 20000, 4
    z = torch.randn(m, k, generator=g) * 1.5 + 1.0
    accepted = (torch.rand(m, k, generator=g) < torch.sigmoid(z)).float()
    temps, before, after = sequential_temperature_scaling(2.5 * z, accepted)
    assert abs(temps[0] - 2.5) < 0.25
    assert all(a <= b + 1e-9 for a, b in zip(after, before))
    assert after[-1] < 0.5 * before[-1]


def test_valid_mask_ignores_truncated_blocks():
    z = torch.zeros(10, 3)
    acc = torch.ones(10, 3)
    valid = torch.ones(10, 3, dtype=torch.bool)
    valid[:, 2] = False
    temps, _, _ = sequential_temperature_scaling(z, acc, valid)
    assert temps[2] == 1.0
