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


def test_temperatures_fitted_on_one_split_help_on_another():
    """Two independent draws of the same over-confident head: fitted on the first, the survival
    ECE measured on the second drops, and on the fitted split it equals what the fit reports.
    The ECE is recomputed here from its definition (equal-width bins, |mean confidence − mean
    outcome| weighted by the bin's share) as an independent check of `survival_ece`."""
    from dspark.calibration import survival_ece

    def draw(seed):
        g = torch.Generator().manual_seed(seed)
        z = torch.randn(20000, 3, generator=g) * 1.5 + 1.0
        return 2.5 * z, (torch.rand(20000, 3, generator=g) < torch.sigmoid(z)).float()

    (fit_logits, fit_acc), (other_logits, other_acc) = draw(0), draw(1)
    temps, before, after = sequential_temperature_scaling(fit_logits, fit_acc)
    assert survival_ece(fit_logits, fit_acc) == before
    assert survival_ece(fit_logits, fit_acc, temperatures=temps) == after
    measured_before = survival_ece(other_logits, other_acc)
    measured_after = survival_ece(other_logits, other_acc, temperatures=temps)
    assert all(a < 0.5 * b for a, b in zip(measured_after, measured_before))

    def ece(pred, label, bins=15):
        idx = torch.clamp((pred * bins).long(), max=bins - 1)
        return sum(
            float((pred[idx == b].mean() - label[idx == b].mean()).abs()) * int((idx == b).sum()) / len(pred)
            for b in range(bins)
            if (idx == b).any()
        )

    survive = torch.cumprod(other_acc, dim=1)
    prefix = torch.cumprod(torch.sigmoid(other_logits / torch.tensor(temps)), dim=1)
    for j in range(3):
        assert abs(measured_after[j] - ece(prefix[:, j], survive[:, j])) < 1e-4
