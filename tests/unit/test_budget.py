"""A time budget: the planner's projection against hand-computed figures, the ledger's shortened
plan (nothing leaks from the store, the record proves the shortened plan complete, a resume under
the full plan is accepted), and the LR schedule whose horizon moves while training."""

from __future__ import annotations

import pytest
import torch

from cluster.data import LedgerError, ProducedSample, SampleLedger, TrainingRecord, trained_outside
from cluster.store import SampleRef
from cluster.training import EpochPlanner, Plan
from dspark.training import OptimConfig, WarmupCosine, build_optimizer


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def prompts(n):
    return [{"id": f"p{i}", "messages": [{"role": "user", "content": str(i)}]} for i in range(n)]


def test_the_planner_keeps_the_epochs_the_measured_pace_trains_by_the_deadline():
    clock = Clock()
    planner = EpochPlanner(deadline=200.0, window=10, slack=0.0, band=0.1, clock=clock)
    with_slack = EpochPlanner(deadline=200.0, window=10, slack=0.05, clock=clock)

    def step(n: int, seconds: float, generating: bool, samples: int = 2) -> None:
        clock.t += seconds
        for p in (planner, with_slack):
            p.on_step(n, samples, generating)

    for n in range(1, 6):  # generation still going: the pace of a trainer waiting for data says nothing
        step(n, 5.0, True)
    assert planner.plan([10, 20, 20, 20], 1) is None
    for n in range(6, 16):  # generation done at step 6 (t=126); from then on 2 samples a step, a step a second
        step(n, 1.0, False)
    assert not planner.ready() and planner.plan([10, 20, 20, 20], 1) is None  # 9 steps measured, not 10
    step(16, 1.0, False)
    # t=136: 20 samples in the 10 s since step 6, 2 a step; 64 s left. All four epochs (70
    # samples, 35 s) fit; the schedule ends 35 steps on; nothing to drop.
    plan = planner.plan([10, 20, 20, 20], 1)
    assert (plan.epochs, plan.horizon_epochs, plan.horizon, plan.drop) == (4, 4, 16 + 35, False)
    assert plan.samples_per_s == pytest.approx(2.0)
    # 110 samples take 55 s, 170 take 85 s: five epochs fit. Epoch 5 is dropped only once
    # epochs 0-4 have all begun (40 samples left, 20 s; with epoch 5, 70 s); until then a faster
    # pace may still fit it.
    assert planner.plan([10, 20, 20, 20, 40, 60], 1) == Plan(5, 5, 16 + 55, pytest.approx(2.0), drop=False)
    assert planner.plan([0, 0, 0, 0, 40, 100], 5) == Plan(5, 5, 16 + 20, pytest.approx(2.0), drop=True)
    # The horizon keeps the epochs it was planned for while they stay within the band (10% of
    # the 64 s: 57.6-70.4 s): 6 epochs (130 samples, 65 s) no longer fit, but within the band;
    # with 150 samples (75 s) it moves to the 5 that fit.
    held = planner.plan([10, 20, 20, 20, 40, 20], 1, horizon_epochs=6)
    assert (held.epochs, held.horizon_epochs, held.horizon) == (5, 6, 16 + 65)
    assert planner.plan([10, 20, 20, 20, 40, 40], 1, horizon_epochs=6).horizon_epochs == 5
    # and from 4 to 5, which fit even at the band's low edge (110 samples: 55 s)
    assert planner.plan([10, 20, 20, 20, 40, 20], 1, horizon_epochs=4).horizon_epochs == 5
    assert planner.plan([400, 400, 20], 2).epochs == 2  # nothing more fits: the begun epochs stay
    # 124 samples take 62 s: inside the 64 s left, not inside the 60.8 s that 5% slack leaves
    assert planner.plan([60, 64, 10], 1).epochs == 2 and with_slack.plan([60, 64, 10], 1).epochs == 1
    # the window slides: ten steps of 4 samples a second later, the pace is 4 samples/s
    for n in range(17, 27):
        step(n, 1.0, False, samples=4)
    assert planner.plan([0, 200], 1).samples_per_s == pytest.approx(4.0)


def test_an_uneven_pace_keeps_a_margin_of_its_spread():
    """Two planners measure the same 1 sample/s, one in even steps of 1 s, one alternating
    0.5 s and 1.5 s. With 20 s left and 16 samples to go, the even one needs 16 s + the last
    step = 17 s and keeps the epoch; the uneven one adds two deviations of a sum of 16 steps
    (2 * 0.741 * 4 = 5.9 s: every step 0.5 s from the median, times 1.4826) and drops it."""
    clock = Clock()
    even = EpochPlanner(deadline=100.0 + 8 + 20, window=8, slack=0.0, clock=clock)
    uneven = EpochPlanner(deadline=100.0 + 8 + 20, window=8, slack=0.0, clock=Clock())
    uneven.clock.t = clock.t
    even.on_step(1, 1, False)
    uneven.on_step(1, 1, False)
    for n in range(2, 10):
        clock.t += 1.0
        uneven.clock.t += 0.5 if n % 2 else 1.5
        even.on_step(n, 1, False)
        uneven.on_step(n, 1, False)
    assert clock.t == uneven.clock.t == 108.0
    assert even.step_seconds() == pytest.approx((1.0, 0.0))
    assert uneven.step_seconds() == pytest.approx((1.0, 1.4826 * 0.5))
    assert even.plan([0, 16], 1).epochs == 2
    assert uneven.plan([0, 16], 1) == Plan(1, 1, 9, pytest.approx(1.0), drop=True)


def test_a_checkpoint_in_the_window_is_in_the_mean_not_in_the_margin():
    """39 steps of 0.5 s and a checkpoint step of 5 s: 0.6125 s a step on average, no spread; 100
    samples at 1 a step take 61.25 s + the last step, and fit in 62 s."""
    clock = Clock()
    planner = EpochPlanner(deadline=100.0 + 24.5 + 62, window=40, slack=0.0, clock=clock)
    planner.on_step(1, 1, False)
    for n in range(2, 42):
        clock.t += 5.0 if n == 21 else 0.5
        planner.on_step(n, 1, False)
    assert planner.step_seconds() == pytest.approx((0.6125, 0.0))
    assert planner.plan([0, 100], 1).epochs == 2 and planner.plan([0, 101], 1).epochs == 1


def test_the_pace_is_measured_again_after_a_rollback_or_more_generation():
    clock = Clock()
    planner = EpochPlanner(window=2, clock=clock)
    for n in (1, 2, 3):
        clock.t += 1.0
        planner.on_step(n, 4, generating=False)
    assert planner.ready()
    planner.on_step(2, 4, generating=False)  # the world went back to its checkpoint
    assert not planner.ready()
    for n in (3, 4):
        clock.t += 10.0
        planner.on_step(n, 4, generating=False)
    assert planner.ready() and planner.plan([8], 0).samples_per_s == pytest.approx(0.4)  # the slower pace since
    planner.on_step(5, 4, generating=True)  # lost samples regenerated
    assert not planner.ready() and not planner.budgeted and not planner.expired()
    assert planner.plan([8], 0) is None
    for n in (6, 7, 8):
        clock.t += 1.0
        planner.on_step(n, 4, generating=False)
    assert planner.ready()
    planner.remeasure()  # a resized world: the minutes of the resize are not one step of the new pace
    assert not planner.ready()


def run_epochs(ledger, record, first_step, epochs):
    """Lease, train and commit whole epochs (one step each, batch large enough for all)."""
    step = first_step
    for _ in range(epochs):
        step += 1
        lease = ledger.lease_step(step, ["g0"], 10_000)
        record.add(step, 0, "g0", lease[0])
        record.commit(step)
        yield step, ledger.commit(step)


@pytest.mark.parametrize("reuse", [True, False])
def test_a_shortened_plan_drops_unbegun_epochs_and_their_stored_samples(reuse, tmp_path):
    ledger = SampleLedger(prompts(4), epochs=5, reuse_across_epochs=reuse)
    record = TrainingRecord(tmp_path / "trained.jsonl")
    store: set[str] = set()

    def generate():
        handed = ledger.request_prompts("r0", 10)
        ledger.report_produced("r0", [ProducedSample(p.uid, SampleRef(p.key, 5, (), 0)) for p in handed])
        store.update(p.key for p in handed)

    generate()
    step = 0
    for _ in range(2):  # epochs 0 and 1
        if not reuse:
            generate()
        for done, removed in run_epochs(ledger, record, step, 1):
            step = done
            store.difference_update(removed)
    if not reuse:
        generate()  # epochs 2 and 3 are generated ahead of their leases
    assert ledger.first_open_epoch() == 2 and ledger.remaining_per_epoch() == [0, 0, 4, 4, 4]
    with pytest.raises(LedgerError, match="epochs up to 1 have begun"):
        ledger.shorten(1)
    assert store  # epoch 2's samples (reused or generated) wait in the store
    store.difference_update(ledger.shorten(2))
    assert not store  # nothing any remaining entry needs is left behind
    assert (
        ledger.drained() and not ledger.outcome()["unfinished"] and ledger.lease_step(step + 1, ["g0"], 10_000) is None
    )
    assert ledger.request_prompts("r0", 10) == []
    proof = record.verify(ledger.outcome(), complete=True)  # the shortened plan, every sample once
    assert proof["per_epoch"] == {"0": 4, "1": 4} and ledger.counts().epochs == 2
    state = ledger.state_dict()
    assert trained_outside(state, {f"p{i}" for i in range(4)}, 5) == []  # resumable under the full plan
    assert trained_outside(state, {f"p{i}" for i in range(4)}, 1) == [f"p{i}@1" for i in range(4)]
    resumed = SampleLedger(prompts(4), epochs=5, reuse_across_epochs=reuse)
    resumed.load_state_dict(state)
    assert resumed.remaining_per_epoch() == [0, 0, 4, 4, 4]  # a later submission trains the rest


def test_an_epoch_in_generation_is_not_dropped():
    ledger = SampleLedger(prompts(2), epochs=3)
    ledger.report_produced(
        "r0", [ProducedSample(p.uid, SampleRef(p.key, 5, (), 0)) for p in ledger.request_prompts("r0", 10)]
    )
    ledger.request_prompts("r0", 10)  # epoch 1 generating (epoch 0 has nothing left to generate)
    assert ledger.first_open_epoch() == 2
    with pytest.raises(LedgerError):
        ledger.shorten(1)
    assert ledger.shorten(2) == [] and sorted(ledger.order) == ["p0@0", "p0@1", "p1@0", "p1@1"]


def test_a_moved_lr_horizon_ends_the_cosine_at_the_new_last_step():
    model = torch.nn.Linear(2, 2)
    opt, sched = build_optimizer(model, OptimConfig(lr=1.0, warmup_steps=2, total_steps=100, min_lr_ratio=0.1))
    for _ in range(10):
        opt.step()
        sched.step()
    for schedule in sched.lr_lambdas:  # as a trainer rank does (TrainerRank.set_lr_horizon)
        schedule.total_steps = 30
    lrs = []
    for _ in range(25):
        opt.step()
        sched.step()
        lrs.append(sched.get_last_lr()[0])
    # closed form: 0.1 + 0.9 * (1 + cos(pi * (s - 2) / 28)) / 2 at step s, the floor from step 30 on
    assert lrs[:20] == pytest.approx(
        [0.1 + 0.45 * (1 + torch.cos(torch.tensor(torch.pi * (s - 2) / 28)).item()) for s in range(11, 31)]
    )
    assert lrs[20:] == pytest.approx([0.1] * 5)
    saved = sched.state_dict()  # the horizon travels with the scheduler's state
    _, fresh = build_optimizer(model, OptimConfig(lr=1.0, warmup_steps=2, total_steps=100, min_lr_ratio=0.1))
    fresh.load_state_dict(saved)
    assert isinstance(fresh.lr_lambdas[0], WarmupCosine) and fresh.lr_lambdas[0].total_steps == 30
