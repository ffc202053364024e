"""The quality flag: raised for a run that trained less than one epoch or whose held-out τ is
below the floor, with the settings to change; not raised for a run that did neither."""

from __future__ import annotations

import pytest

from cluster.job.quality import TAU_FLOOR, assess


def test_less_than_one_epoch_is_flagged_with_the_budget_it_would_take():
    q = assess(trained_samples=192, train_prompts=276, heldout_tau=1.055, ended_by="time_budget", time_budget_s=480)
    assert not q.worth_serving
    assert q.epochs_trained == pytest.approx(192 / 276)
    assert "70% of one epoch of its 276 prompts" in q.reasons[0] and "time_budget" in q.reasons[0]
    assert f"below {TAU_FLOOR}" in q.reasons[1]
    # one epoch at the measured pace: 480 s / (192 / 276)
    assert f"to about {480 / (192 / 276):.0f} for one epoch" in q.advice[0]


def test_a_full_epoch_below_the_floor_is_flagged_a_healthy_run_is_not():
    low = assess(
        trained_samples=2760, train_prompts=276, heldout_tau=TAU_FLOOR - 0.01, ended_by="data", time_budget_s=None
    )
    assert not low.worth_serving and len(low.reasons) == 1 and "train longer" in low.advice[0]
    ok = assess(trained_samples=2760, train_prompts=276, heldout_tau=1.45, ended_by="time_budget", time_budget_s=480)
    assert ok.worth_serving and ok.reasons == [] and ok.advice == [] and ok.epochs_trained == 10
    edge = assess(trained_samples=276, train_prompts=276, heldout_tau=TAU_FLOOR, ended_by="data", time_budget_s=None)
    assert edge.worth_serving  # exactly one epoch and exactly the floor pass
