"""`TrainingLoop`: one global step per iteration on the driver's main thread.

A step is leased from the ledger, read by every rank from the store, trained, recorded; every
`trainer.checkpoint_interval` steps it commits (`Committer`); a failed world or a resize goes
to the `TrainerWorld`. The progress reporter and the autoscaler reach the loop only through the
`ControlChannel` (`handle_requests`). The loop owns the step count (`TrainingStats`, which the
reporter and the autoscaler read) and its waits: when the data last arrived, the run of
non-finite steps, the epochs the LR horizon was planned for. A world that fails while its ranks
hold a step's samples starts the search for a poison sample among them (`PoisonSearch`, whose
module says how): the steps after the restart hold only its suspects until it ends.
"""

from __future__ import annotations

import logging
import time

from cluster.config import TrainerConfig
from cluster.control import ControlChannel
from cluster.data import LedgerClient, TrainingRecord
from cluster.job.checkpointing import Committer
from cluster.job.events import EventLog
from cluster.job.plan_revision import PlanRevision
from cluster.job.poison import BROKEN_WORLD, POISON, PoisonSearch, Verdict, lease_test
from cluster.job.progress import ProgressReporter, TrainingStats
from cluster.job.recovery import TrainerWorld
from cluster.job.supervision import Supervisor
from cluster.training import EpochPlanner, StepResult, TrainerFailure, TrainerGang

log = logging.getLogger("dspark.job")


class TrainingLoop:
    def __init__(
        self,
        trainer: TrainerConfig,
        cpu: bool,
        ledger: LedgerClient,
        gang: TrainerGang,
        world: TrainerWorld,
        committer: Committer,
        record: TrainingRecord,
        supervisor: Supervisor,
        reporter: ProgressReporter,
        planner: EpochPlanner,
        stats: TrainingStats,
        control: ControlChannel,
        events: EventLog,
        revision: PlanRevision | None = None,
    ) -> None:
        self.t, self.cpu, self.ledger, self.gang, self.world = trainer, cpu, ledger, gang, world
        self.committer, self.record, self.supervisor, self.reporter = committer, record, supervisor, reporter
        self.planner, self.stats, self.control, self.events = planner, stats, control, events
        self.revision = revision  # the box plan's second look, after the first set-up (None: none)
        self.nonfinite_streak = 0
        # the epochs the LR horizon was last measured for (cluster.training.budget)
        self.horizon_epochs: int | None = None
        self.produced_seen, self.produced_at = 0, time.monotonic()  # for the stalled-store commit
        self.waiting_since: float | None = None  # the first of the current run of steps without data
        self.search = PoisonSearch()
        self.in_flight: tuple[int, list[str]] | None = None  # the step (and its samples) the ranks hold now

    def run(self, begun: bool = False) -> str:
        """One global step per iteration, until the data is trained (or max_steps, or a stop);
        what ended it: data | max_steps | time_budget | stop. A failed trainer world is restarted
        from the last checkpoint (bounded), its first set-up (`begin`, unless `begun`) included."""
        t, s = self.t, self.stats
        if not begun:
            try:
                s.step = self.world.begin()
            except TrainerFailure as e:
                self.restart(e)
            if self.revision is not None:
                self.revision.after_first_answers(self.world.first_answers_pace)
        while True:
            try:
                self.supervisor.check()
                if self.handle_requests():
                    return "stop"
                if t.max_steps and s.step >= t.max_steps:
                    return "max_steps"
                if self.planner.expired():
                    self.events.add(f"trainer.time_budget_s={t.time_budget_s:g} reached at step {s.step}")
                    return "time_budget"
                if self.global_step() == "drained":
                    return "data"
            except TrainerFailure as e:
                self.restart(e)

    def restart(self, cause: Exception) -> None:
        """A new world from the last checkpoint. A failure while the ranks held a step's samples
        starts the poison-sample search, or is one of its tests: those restarts the search
        bounds itself, outside the trainer's restart budget."""
        failed, self.in_flight = self.in_flight, None
        budgeted = True
        if failed is not None and self.search.active():
            budgeted = False
            self.events.add(f"step {failed[0]}: the world failed again, on {len(failed[1])} samples of the search")
            self.conclude(self.search.failed(*failed, str(cause)))
        elif failed is not None:
            self.events.add(self.search.start(*failed, str(cause)), logging.WARNING)
        self.stats.step = self.world.restart(cause, budgeted=budgeted)

    def conclude(self, verdict: Verdict | None) -> None:
        """The search's verdict, if it ended: a poison sample is quarantined (in every epoch); a
        world that fails whatever its samples ends the job."""
        if verdict is None:
            return
        if verdict.kind == BROKEN_WORLD:
            raise RuntimeError(verdict.message)
        if verdict.kind == POISON:
            self.ledger.quarantine_sample(verdict.uid, verdict.cause)
        self.events.add(verdict.message, logging.WARNING if verdict.kind == POISON else logging.INFO)

    def lease(self, step: int):
        """The next step's samples: while a poison-sample search is on, only its next test's."""
        ledger, groups, tokens = self.ledger, self.gang.rank_groups, self.t.batch_tokens
        if self.search.active():
            lease, verdict = lease_test(self.search, ledger, step, groups, tokens)
            if lease is not None:
                return lease
            self.conclude(verdict)
        return ledger.lease_step(step, groups, tokens)

    def global_step(self) -> str:
        """Assemble, read and train step `step + 1`: "stepped", "waited" (no data, or data that
        cannot be trained: given back), "skipped" (a non-finite loss) or "drained"."""
        t, s, ledger, gang = self.t, self.stats, self.ledger, self.gang
        t0 = time.perf_counter()
        lease = self.lease(s.step + 1)
        if lease is None:
            if ledger.drained():
                return "drained"
            self.wait_for_data()
            s.data_wait_s += time.perf_counter() - t0
            return "waited"
        self.waiting_since = None
        uids = [row.uid for rows in lease for row in rows]
        self.in_flight = (s.step + 1, uids)  # (what a failure of the world from here to the update is blamed on)
        bad = gang.fetch(s.step + 1, lease)
        if bad:  # gone from the store (a daemon or the master died) or unusable: regenerate them
            self.in_flight = None
            ledger.release_lease(s.step + 1, bad)
            self.events.add(
                f"step {s.step + 1}: {len(bad)} samples could not be read, e.g. "
                f"{next(iter(bad))}: {next(iter(bad.values()))}; regenerating"
            )
            return "waited"
        s.data_wait_s += time.perf_counter() - t0
        generating = ledger.to_generate() > 0
        if self.cpu:
            gang.set_threads(t.torch_threads if generating else t.torch_threads_when_idle)
        t1 = time.perf_counter()
        per_rank = gang.train_step(s.step + 1, lease)
        self.in_flight = None
        s.train_s += time.perf_counter() - t1
        if per_rank[0].skipped:
            self.nonfinite_step(s.step + 1, per_rank)
            return "skipped"
        self.nonfinite_streak = 0
        s.step, s.last = s.step + 1, next((m for m in per_rank if m.loss is not None), per_rank[0])
        for m, group in zip(per_rank, gang.rank_groups):
            self.record.add(s.step, m.rank, group, m.trained)
        if self.search.active():
            self.events.add(f"step {s.step}: {len(uids)} samples of the search trained")
            self.conclude(self.search.passed(s.step, uids))
        rows = [row for rank_rows in lease for row in rank_rows]
        if t.release_samples == "after_step":
            self.release_before(s.step)
        self.committer.add(rows)
        self.reporter.on_step(s.step, per_rank)
        # The last step's samples stay uncommitted (and in the store) for the final calibration.
        if s.step % t.checkpoint_interval == 0 and not ledger.drained():
            self.committer.commit(s.step)
        self.follow_plan(len(rows), generating)
        return "stepped"

    def follow_plan(self, samples: int, generating: bool) -> None:
        """Once the pace is measured (`cluster.training.budget`): end the LR schedule where the
        epochs that fit in `trainer.time_budget_s` end, and drop the others when they would
        begin. Without a budget the horizon is measured once."""
        planner = self.planner
        planner.on_step(self.stats.step, samples, generating)
        if not planner.ready() or (self.horizon_epochs is not None and not planner.budgeted):
            return
        remaining = self.ledger.remaining_per_epoch()
        plan = planner.plan(remaining, self.ledger.first_open_epoch(), self.horizon_epochs)
        if plan is None:
            return
        if plan.drop:
            self.gang.remove_keys(self.ledger.shorten(plan.epochs))
            self.events.add(
                f"step {self.stats.step}: {plan.epochs} of {len(remaining)} epochs fit in trainer.time_budget_s="
                f"{self.t.time_budget_s:g} at {plan.samples_per_s:.2f} samples/s; the others are dropped"
            )
        if plan.horizon_epochs != self.horizon_epochs:
            horizon, was = min(plan.horizon, self.t.max_steps or plan.horizon), self.gang.settings.total_steps
            log.info(
                "LR schedule: ends at step %d (was %d): %d of %d epochs fit at %.2f samples/s",
                horizon,
                was,
                plan.horizon_epochs,
                len(remaining),
                plan.samples_per_s,
            )
            if horizon != was:
                self.gang.set_lr_horizon(horizon)  # (first: if the world fails here, the next plan sets it again)
            self.horizon_epochs = plan.horizon_epochs

    def nonfinite_step(self, step: int, per_rank: list[StepResult]) -> None:
        """No rank updated: every sample of the step is leased again (those of the ranks whose
        loss was not finite are FAILED after max attempts of that)."""
        ranks = [m.rank for m in per_rank if m.nonfinite]
        bad = {uid: f"non-finite loss on rank {m.rank}" for m in per_rank if m.nonfinite for uid in m.batch}
        self.ledger.release_lease(step, bad, "non-finite loss", False)
        self.nonfinite_streak += 1
        self.stats.skipped_steps += 1
        self.events.add(f"step {step}: non-finite loss on ranks {ranks}; update skipped on every rank", logging.WARNING)
        if self.nonfinite_streak >= self.t.max_nonfinite_steps:
            raise RuntimeError(
                f"{self.nonfinite_streak} consecutive steps had a non-finite loss (the last at step {step}, "
                f"ranks {ranks}): the drafter diverged; lower trainer.lr or check the data "
                f"(trainer.max_nonfinite_steps={self.t.max_nonfinite_steps})"
            )

    def release_before(self, step: int) -> None:
        """`trainer.release_samples=after_step`: the previous step's samples leave the store and
        the uncommitted rows; the newest step's stay, for the final calibration."""
        keys = self.ledger.release(step - 1)
        if keys:
            self.gang.remove_keys(keys)
        self.committer.forget()

    def wait_for_data(self) -> None:
        """No rank got anything for the next step. If trained-but-uncommitted samples fill the
        store (it holds fewer than checkpoint_interval steps), only a commit makes room: commit
        when a group's producers are held back (its watermark), or when nothing has been stored
        for `trainer.stall_commit_s` while samples are in generation (their puts may be waiting
        for room that only a commit frees: Mooncake evicts nothing)."""
        counts, now = self.ledger.counts(), time.monotonic()
        produced = counts.produced_samples
        if produced != self.produced_seen:
            self.produced_seen, self.produced_at = produced, now
        if self.waiting_since is None:
            self.waiting_since = now
        check_data_deadline(now - max(self.waiting_since, self.produced_at), self.t.data_timeout_s, counts)
        stalled = counts.generating and now - self.produced_at > self.t.stall_commit_s
        if self.committer.uncommitted and (counts.paused or stalled):
            why = "store full of uncommitted samples" if counts.paused else "nothing stored for a while"
            self.events.add(f"step {self.stats.step}: {why}, checkpointing early")
            self.committer.commit(self.stats.step)
            self.produced_at = time.monotonic()
        else:
            time.sleep(0.2)  # then back to the loop, which also handles a stop or a resize meanwhile

    def handle_requests(self) -> bool:
        """Apply what other threads asked for: a resize (at a checkpoint boundary), a stop."""
        resize_request, stop = self.control.take()
        if stop is not None:
            self.events.add(f"stopped at step {self.stats.step}: {stop.reason}")
            return True
        if resize_request is not None:
            s = self.stats
            if self.world.resize(resize_request, s.step):
                s.ranks, s.layout = self.gang.size, self.gang.layout()
                self.planner.remeasure()  # another world, another pace (and the resize's own minutes are not one step)
            s.resize_seq_handled = resize_request.seq
        return False


def check_data_deadline(idle_s: float, timeout_s: float, counts) -> None:
    """Past `trainer.data_timeout_s` without anything to train: stop, saying where the samples are."""
    if idle_s <= timeout_s:
        return
    groups = (
        ", ".join(
            f"{name}: {g.generating} generating, {g.stored} stored{' (paused)' if g.paused else ''}"
            for name, g in sorted(counts.groups.items())
        )
        or "no group has asked for prompts"
    )
    raise RuntimeError(
        f"nothing to train for {idle_s:.0f}s (trainer.data_timeout_s={timeout_s:g}): "
        f"{counts.pending} pending, {counts.generating} generating, {counts.stored} stored, "
        f"{counts.leased} leased, {counts.failed} failed of {counts.total} (generating epoch index "
        f"{counts.epoch} of {counts.epochs}); by group: {groups}. Look at the replicas' "
        f"logs (the Ray dashboard) for why nothing is stored"
    )
