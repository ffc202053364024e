"""The training loop: one global step per iteration on the driver's main thread.

A step is leased from the ledger, read by every rank from the store, trained, recorded; every
`trainer.checkpoint_interval` steps it commits (`checkpointing`); a failed world or a resize
goes to `recovery`. The progress reporter and the autoscaler reach the loop only through the
job's `ControlChannel` (`handle_requests`).
"""

from __future__ import annotations

import logging
import time

from cluster.job.checkpointing import checkpoint
from cluster.job.recovery import begin, resize, restart_trainer, supervise
from cluster.data.ledger_rows import LeasedSample
from cluster.training import StepResult, TrainerFailure

log = logging.getLogger("dspark.job")


def train(job, begun: bool = False) -> None:
    """One global step per iteration, until the data is trained (or max_steps, or a stop).
    A failed trainer world is restarted from the last checkpoint (bounded), its first set-up
    (`begin`, unless `begun`) included."""
    t, s = job.cfg.trainer, job.stats
    if not begun:
        try:
            s.step = begin(job)
        except TrainerFailure as e:
            restart_trainer(job, e)
    while True:
        try:
            supervise(job)
            if handle_requests(job):
                break
            if t.max_steps and s.step >= t.max_steps:
                job.ended_by = "max_steps"
                break
            if job.planner.expired():
                job.ended_by = "time_budget"
                job.events.append(f"trainer.time_budget_s={t.time_budget_s:g} reached at step {s.step}")
                break
            if global_step(job) == "drained":
                break
        except TrainerFailure as e:
            restart_trainer(job, e)


def global_step(job) -> str:
    """Assemble, read and train step `step + 1`: "stepped", "waited" (no data, or data that
    cannot be trained: given back), "skipped" (a non-finite loss) or "drained"."""
    t, s = job.cfg.trainer, job.stats
    t0 = time.perf_counter()
    lease = job.ledger.lease_step(s.step + 1, job.gang.rank_groups, t.batch_tokens)
    if lease is None:
        if job.ledger.drained():
            return "drained"
        wait_for_data(job)
        s.data_wait_s += time.perf_counter() - t0
        return "waited"
    job.waiting_since = None
    bad = job.gang.fetch(s.step + 1, lease)
    if bad:  # gone from the store (a daemon or the master died) or unusable: regenerate them
        job.ledger.release_lease(s.step + 1, bad)
        job.events.append(f"step {s.step + 1}: {len(bad)} samples could not be read, e.g. "
                           f"{next(iter(bad))}: {next(iter(bad.values()))}; regenerating")
        return "waited"
    s.data_wait_s += time.perf_counter() - t0
    generating = job.ledger.to_generate() > 0
    if job.cfg.device == "cpu":
        job.gang.set_threads(t.torch_threads if generating else t.torch_threads_when_idle)
    t1 = time.perf_counter()
    per_rank = job.gang.train_step(s.step + 1, lease)
    s.train_s += time.perf_counter() - t1
    if per_rank[0].skipped:
        nonfinite_step(job, s.step + 1, per_rank)
        return "skipped"
    job.nonfinite_streak = 0
    s.step, s.last = s.step + 1, next((m for m in per_rank if m.loss is not None), per_rank[0])
    for m, group in zip(per_rank, job.gang.rank_groups):
        job.record.add(s.step, m.rank, group, m.trained)
    rows = [row for rank_rows in lease for row in rank_rows]
    job.uncommitted = release_before(job, s.step, rows) if t.release_samples == "after_step" else job.uncommitted + rows
    job.reporter.on_step(s.step, per_rank)
    # The last step's samples stay uncommitted (and in the store) for the final calibration.
    if s.step % t.checkpoint_interval == 0 and not job.ledger.drained():
        checkpoint(job)
    follow_plan(job, len(rows), generating)
    return "stepped"


def follow_plan(job, samples: int, generating: bool) -> None:
    """Once the pace is measured (`cluster.training.budget`): end the LR schedule where the epochs
    that fit in `trainer.time_budget_s` end, and drop the others when they would begin.
    Without a budget the horizon is measured once."""
    planner = job.planner
    planner.on_step(job.stats.step, samples, generating)
    if not planner.ready() or (job.horizon_epochs is not None and not planner.budgeted):
        return
    remaining = job.ledger.remaining_per_epoch()
    plan = planner.plan(remaining, job.ledger.first_open_epoch(), job.horizon_epochs)
    if plan is None:
        return
    if plan.drop:
        job.gang.remove_keys(job.ledger.shorten(plan.epochs))
        job.events.append(f"step {job.stats.step}: {plan.epochs} of {len(remaining)} epochs fit in trainer.time_budget_s="
                           f"{job.cfg.trainer.time_budget_s:g} at {plan.samples_per_s:.2f} samples/s; the others are dropped")
        log.info("%s", job.events[-1])
    if plan.horizon_epochs != job.horizon_epochs:
        horizon = min(plan.horizon, job.cfg.trainer.max_steps or plan.horizon)
        log.info("LR schedule: ends at step %d (was %d): %d of %d epochs fit at %.2f samples/s", horizon,
                 job.total_steps, plan.horizon_epochs, len(remaining), plan.samples_per_s)
        if horizon != job.total_steps:
            job.gang.set_lr_horizon(horizon)  # (first: if the world fails here, the next plan sets it again)
            job.total_steps = horizon
        job.horizon_epochs = plan.horizon_epochs


def nonfinite_step(job, step: int, per_rank: list[StepResult]) -> None:
    """No rank updated: every sample of the step is leased again (those of the ranks whose
    loss was not finite are FAILED after max attempts of that)."""
    ranks = [m.rank for m in per_rank if m.nonfinite]
    bad = {uid: f"non-finite loss on rank {m.rank}" for m in per_rank if m.nonfinite for uid in m.batch}
    job.ledger.release_lease(step, bad, "non-finite loss", False)
    job.nonfinite_streak += 1
    job.stats.skipped_steps += 1
    job.events.append(f"step {step}: non-finite loss on ranks {ranks}; update skipped on every rank")
    log.warning("%s", job.events[-1])
    if job.nonfinite_streak >= job.cfg.trainer.max_nonfinite_steps:
        raise RuntimeError(f"{job.nonfinite_streak} consecutive steps had a non-finite loss (the last at step {step}, "
                           f"ranks {ranks}): the drafter diverged; lower trainer.lr or check the data "
                           f"(trainer.max_nonfinite_steps={job.cfg.trainer.max_nonfinite_steps})")


def release_before(job, step: int, rows: list[LeasedSample]) -> list[LeasedSample]:
    """`trainer.release_samples=after_step`: the previous step's samples leave the store; the
    newest step's (`rows`) stay, for the final calibration, and are what is left in it."""
    keys = job.ledger.release(step - 1)
    if keys:
        job.gang.remove_keys(keys)
    return rows


def wait_for_data(job) -> None:
    """No rank got anything for the next step. If trained-but-uncommitted samples fill the
    store (it holds fewer than checkpoint_interval steps), only a commit makes room: commit
    when a group's producers are held back (its watermark), or when nothing has been stored
    for `trainer.stall_commit_s` while samples are in generation (their puts may be waiting
    for room that only a commit frees: Mooncake evicts nothing)."""
    counts, now = job.ledger.counts(), time.monotonic()
    produced = counts.produced_samples
    if produced != job.produced_seen:
        job.produced_seen, job.produced_at = produced, now
    if job.waiting_since is None:
        job.waiting_since = now
    check_data_deadline(now - max(job.waiting_since, job.produced_at), job.cfg.trainer.data_timeout_s, counts)
    stalled = counts.generating and now - job.produced_at > job.cfg.trainer.stall_commit_s
    if job.uncommitted and (counts.paused or stalled):
        why = "store full of uncommitted samples" if counts.paused else "nothing stored for a while"
        job.events.append(f"step {job.stats.step}: {why}, checkpointing early")
        log.info("%s", job.events[-1])
        checkpoint(job)
        job.produced_at = time.monotonic()
    else:
        time.sleep(0.2)  # then back to the loop, which also handles a stop or a resize meanwhile


def check_data_deadline(idle_s: float, timeout_s: float, counts) -> None:
    """Past `trainer.data_timeout_s` without anything to train: stop, saying where the samples are."""
    if idle_s <= timeout_s:
        return
    groups = ", ".join(f"{name}: {g.generating} generating, {g.stored} stored{' (paused)' if g.paused else ''}"
                       for name, g in sorted(counts.groups.items())) or "no group has asked for prompts"
    raise RuntimeError(f"nothing to train for {idle_s:.0f}s (trainer.data_timeout_s={timeout_s:g}): "
                       f"{counts.pending} pending, {counts.generating} generating, {counts.stored} stored, "
                       f"{counts.leased} leased, {counts.failed} failed of {counts.total} (generating epoch index "
                       f"{counts.epoch} of {counts.epochs}); by group: {groups}. Look at the replicas' "
                       f"logs (the Ray dashboard) for why nothing is stored")


def handle_requests(job) -> bool:
    """Apply what other threads asked for: a resize (at a checkpoint boundary), a stop."""
    resize_request, stop = job.control.take()
    if stop is not None:
        job.events.append(f"stopped at step {job.stats.step}: {stop.reason}")
        job.ended_by = "stop"
        return True
    if resize_request is not None:
        resize(job, resize_request)
    return False
