"""`trainer.time_budget_s` on a real local run (replay backend, each step slowed by half a
second): the epochs the measured pace cannot train by the deadline are dropped before they
begin, the record proves the shortened plan trained exactly once, and the LR schedule ends where
the plan does."""

from __future__ import annotations

import pytest

from tests.integration.test_faults import N, start_job

# Slow (47 s on a 2-core Xeon; the suite's 15 minutes): the planner's arithmetic is in
# tests/unit/test_budget.py, and the local job's time budget is exercised by every local run.
pytestmark = [pytest.mark.integration, pytest.mark.slow]
# Start-up (placement, the store, DeepSpeed's world) took 12 s on a 2-core Xeon and 30-35 s on
# one in a slow hour, where 36 s left no room to measure a pace and 48 s not one epoch of the 40
# prompts (37 samples trained, ended by the budget): 64 leaves it, and 8 epochs (~80 s of
# training) still do not fit.
BUDGET_S = 64


def test_a_time_budget_drops_the_epochs_it_cannot_train(ray_cluster, smol_target, replay_dir, tmp_path):
    # 8 epochs of ~14 steps at ~0.7 s: over a minute of training, twice what the budget leaves
    # after the job's start-up
    job = start_job(
        tmp_path,
        replay_dir,
        "budget",
        [
            "data.epochs=8",
            "testing.trainer_throttle_s=0.5",
            f"trainer.time_budget_s={BUDGET_S}",
            "trainer.checkpoint_interval=5",
        ],
    )
    result = job.run()
    kept = result["epochs"]["kept"]
    assert result["epochs"]["planned"] == 8 and 1 <= kept < 8, result["epochs"]
    shortened = [e for e in result["events"] if f"fit in trainer.time_budget_s={BUDGET_S}" in e]
    assert len(shortened) >= 1 and shortened[-1].split(": ", 1)[1].startswith(f"{kept} of "), result["events"]
    # the plan, shortened before its dropped epochs began, ended by its data, inside the budget
    assert result["ended_by"] == "data" and result["trained_until_s"] <= BUDGET_S + 2, result["trained_until_s"]
    proof = result["exactly_once"]
    assert proof["per_epoch"] == {str(e): N for e in range(kept)} and proof["not_trained"] == 0 and not proof["failed"]
    assert proof["trained"] == N * kept
    # the cosine ends at the real last step, not at 8 epochs' worth
    assert abs(result["lr_horizon"] - result["steps"]) <= 0.1 * result["steps"], (result["lr_horizon"], result["steps"])
