"""Resume and recovery: what a checkpoint allows, and the trainer world through its life.

Before anything starts, a resume is checked against the config's plan (`check_resume_plan`);
at start the ledger and the record are set back to the checkpoint (`restore_data_state`).
`TrainerWorld` owns the trainer's placement groups and its restarts: it begins from the
checkpoint (or fresh, its draft vocabulary counted on the first stored answers), restarts a
failed world from the last checkpoint (bounded) and places a new world for a resize at a
checkpoint boundary.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from cluster.config import ConfigError, JobConfig
from cluster.control import ResizeTrainer
from cluster.data import LedgerClient, TrainingRecord, load_ledger_state, trained_outside
from cluster.job.checkpointing import Committer
from cluster.job.events import EventLog
from cluster.job.supervision import Supervisor
from cluster.restart_budget import RestartBudget
from cluster.store import StoreServices
from cluster.training import CheckpointDir, TrainerFailure, TrainerGang
from cluster.waiting import wait_until

log = logging.getLogger("dspark.job")
VOCAB_SAMPLES = 64  # stored answers the draft vocabulary is counted on, at a fresh start


def check_resume_plan(
    cfg: JobConfig, checkpoints: CheckpointDir, train_ids: set[str], heldout_ids: set[str]
) -> Path | None:
    """The checkpoint a resume would start from (None: a fresh start). Refuses, before any actor
    starts, a resume whose checkpoint trained samples this config no longer plans: changed prompt
    files, `data.max_prompts(_per_category)`, held-out split or fewer epochs. The ledger would
    drop them and train another set under the old record (or, with a changed split, may have
    trained on prompts now evaluated). A plan that only adds samples (more epochs, another prompt
    file) resumes. `trainer.resume=always` with no whole checkpoint is refused here too."""
    t = cfg.trainer
    ckpt = checkpoints.latest() if t.resume != "never" else None
    if t.resume == "always" and ckpt is None:
        raise ConfigError(f"config error at `trainer.resume`: always, but no whole checkpoint under {checkpoints.root}")
    if ckpt is None:
        return None
    outside = trained_outside(load_ledger_state(ckpt), train_ids, cfg.data.epochs)
    if not outside:
        return ckpt
    heldout = heldout_ids & {u.rsplit("@", 1)[0] for u in outside}
    raise ConfigError(
        f"{ckpt} trained {len(outside)} samples this config does not plan to train (e.g. {', '.join(outside[:3])})"
        + (f"; {len(heldout)} of their prompts are now held out for evaluation" if heldout else "")
        + ": the prompt files, data.max_prompts, data.max_prompts_per_category, data.heldout_fraction, "
        "data.split_seed or data.epochs differ from the run that wrote it. Restore them to resume, or start "
        "afresh with trainer.resume=never (earlier checkpoints are moved aside)."
    )


def restore_data_state(
    resume: Path | None,
    checkpoints: CheckpointDir,
    ledger: LedgerClient,
    record: TrainingRecord,
    gang: TrainerGang,
    master_generation: int,
    events: EventLog,
) -> Path | None:
    """The checkpoint to resume from (`check_resume_plan`'s), with the ledger and the training
    record already set back to it (samples it did not commit leave the store); or a fresh start
    (earlier checkpoints of this run name moved aside, no record)."""
    if resume is None:
        moved = checkpoints.archive()  # a fresh run must not rotate into an old run's steps
        if moved:
            events.add(f"fresh start: earlier checkpoints moved to {moved}")
        record.reset()
        return None
    stale = ledger.load_state_dict(load_ledger_state(resume), master_generation)
    ledger.settle()
    gang.remove_keys(stale)
    record.rollback_to(checkpoints.meta(resume)["record_rows"])
    events.add(f"resumed from {resume}")
    return resume


@dataclass(frozen=True)
class FirstAnswersPace:
    tok_s: float  # tokens generated per second, every replica together
    tokens: int  # generated in all by the end of the wait
    seconds: float  # since prompts were first seen handed out


class TrainerWorld:
    """The trainer gang's placement and life: `begin`, `restart` (bounded by
    `trainer.max_restarts` within any `trainer.restart_window_s`), `resize`. `resume_from` is
    the checkpoint the next `begin` loads."""

    def __init__(
        self,
        cfg: JobConfig,
        gang: TrainerGang,
        services: StoreServices,
        ledger: LedgerClient,
        record: TrainingRecord,
        checkpoints: CheckpointDir,
        committer: Committer,
        supervisor: Supervisor,
        events: EventLog,
        vocab_texts: list[str],
        train_prompts: int,
        resume_from: Path | None,
        stop_check: Callable[[str], None],
    ) -> None:
        """`stop_check(phase)`: raises JobStopped once a stop was sent (the first answers' wait
        and a restart's retries check it)."""
        self.cfg, self.gang, self.services, self.ledger, self.record = cfg, gang, services, ledger, record
        self.checkpoints, self.committer, self.supervisor, self.events = checkpoints, committer, supervisor, events
        self.vocab_texts, self.train_prompts, self.resume_from = vocab_texts, train_prompts, resume_from
        self.stop_check = stop_check
        self.placement: list = []  # the trainer's placement groups
        self.generation = 0  # bumped per trainer placement after the first: new placement group names
        self.restarts = RestartBudget(cfg.trainer.max_restarts, cfg.trainer.restart_window_s)
        # the replicas' pace while the first answers were awaited (a fresh start's; None if they
        # were all there at the first look): what the box plan's second look goes by
        self.first_answers_pace: FirstAnswersPace | None = None

    def start(self, placed: list) -> None:
        """A trainer world on the placement groups `placed`: the store daemons of their nodes
        first (the ranks are store clients of them), then the ranks."""
        self.placement = placed
        self.services.ensure_node_stores(placed)
        self.gang.settings = replace(self.gang.settings, store=self.services.store_config())
        self.gang.start(placed)

    def stop(self) -> None:
        """The ranks stop and the world's placement groups are freed."""
        from cluster.scaling import release

        self.gang.stop()
        release(self.placement)
        self.placement = []

    def begin(self) -> int:
        """The world's drafter and engines: from `resume_from`, or fresh (the draft vocabulary
        counted on the first stored answers); the step it starts from."""
        if self.resume_from is None:
            return self.gang.setup(self.fresh_model_init(), None, False)
        model_init = self.gang.read_drafter(str(self.resume_from / "drafter"))
        resized = self.checkpoints.meta(self.resume_from)["world_size"] != self.gang.size
        return self.gang.setup(model_init, self.resume_from, resized)

    def restart(self, cause: Exception, budgeted: bool = True) -> int:
        """The world failed (a rank died, hung or raised): a new world from the last checkpoint;
        the step it starts from. The ledger gives back what was leased after it (re-read, or
        regenerated if released), the training record drops the rows it did not commit. A
        restart that fails itself counts as the next one. `budgeted=False`: a restart the
        poison-sample search bounds itself (`cluster.job.poison`) takes nothing of the budget
        (its own failed tries do)."""
        from cluster.scaling import place_all, trainer_specs

        layout = self.gang.layout()
        while True:
            self.stop_check("a trainer restart")
            spend, budgeted = budgeted, True
            if spend and not self.restarts.spend():
                raise RuntimeError(
                    f"the trainer world failed {self.restarts.recent() + 1} times within "
                    f"{self.restarts.window_s:g} s (trainer.max_restarts={self.restarts.limit} per "
                    f"trainer.restart_window_s); last: {cause}"
                )
            self.stop()
            try:
                self.services.check(force=True)  # a dead store daemon (what may have killed the ranks) first
                self.generation += 1
                self.start(place_all(self.cfg, trainer_specs(self.cfg, layout, self.generation)))
                ckpt = self.checkpoints.latest()
                returned = self.ledger.trainer_restarted(self.checkpoints.meta(ckpt)["step"] if ckpt else 0)
                self.record.rollback_to(self.checkpoints.meta(ckpt)["record_rows"] if ckpt else 0)
                self.committer.forget()
                self.events.add(
                    f"trainer world restarted from {ckpt.name if ckpt else 'scratch'} "
                    f"({returned} leased samples given back): {cause}",
                    logging.WARNING,
                )
                self.resume_from = ckpt
                return self.begin()
            except TrainerFailure as e:
                cause = e

    def resize(self, request: ResizeTrainer, step: int) -> bool:
        """A new world with `request`'s ranks per group, at a checkpoint boundary: commit, stop
        the ranks, place and start the new ones, reload. If the new layout cannot be placed, the
        old one is placed again (its resources were just freed). Whether a new world began."""
        from cluster.scaling import PlacementError, place, release, trainer_specs

        old = self.gang.layout()
        want = {**old, **request.ranks}
        if want == old:
            return False
        ckpt = self.committer.commit(step)
        self.stop()
        timeout = self.cfg.autoscaler.placement_timeout_s
        for layout in (want, old):
            self.generation += 1
            placed = []
            try:
                for spec in trainer_specs(self.cfg, layout, self.generation):
                    placed.append(place(spec, timeout))
                break
            except PlacementError as e:
                release(placed)
                if layout == old:
                    raise
                self.events.add(f"trainer resize {old}->{want} not placed ({e}); staying at {old}", logging.WARNING)
        self.start(placed)
        resized = self.gang.size != sum(old.values())  # the old layout placed again keeps its optimizer state
        self.gang.setup(self.gang.read_drafter(str(ckpt / "drafter")), ckpt, resized)
        if self.gang.layout() != old:
            self.events.add(f"trainer resized {old}->{self.gang.layout()} at step {step}")
        return True

    def fresh_model_init(self) -> dict:
        if not self.cfg.drafter.draft_vocab_size:
            return {}
        # More answers cover more of what the drafter will predict (on the default prompts, 64
        # instead of 16 draft-vocab ~94 % of held-out answer tokens instead of 92 %); waiting
        # costs little: epoch 0 can only be trained as it arrives.
        want = min(VOCAB_SAMPLES, self.train_prompts)
        rows, counts = [], None
        # When prompts were first seen handed out: answers arrive a replica's batch at a time (64
        # at once on the local job), so the pace is what was generated since then
        handed_out: list[float] = []

        def stored_enough():
            nonlocal rows, counts
            self.stop_check("the first answers' wait")
            rows = self.ledger.peek_stored(want)
            counts = self.ledger.counts()
            if not handed_out and (counts.generating or counts.produced_tokens):
                handed_out.append(time.monotonic())
            # A full store (producers paused) or nothing left to generate: take what there is.
            if len(rows) >= want or (rows and (counts.paused or counts.to_generate == 0)):
                return True
            if not rows and counts.to_generate == 0 and not counts.generating:
                failed = self.ledger.outcome()["failed"]
                example = next(iter(failed.items()), ("-", ["?"]))
                raise RuntimeError(
                    f"no answer could be stored: {len(failed)} prompt x epochs FAILED, e.g. {example[0]}: "
                    f"{example[1][-1] if example[1] else '?'}"
                )
            self.supervisor.check()  # replicas that die before the first answers are replaced meanwhile
            return False

        timeout = self.cfg.inference.first_samples_timeout_s
        log.info("waiting for the first %d stored answers (the draft vocabulary is counted on them)", want)

        def timed_out():
            ledger = {
                "pending": counts.pending,
                "generating": counts.generating,
                "stored": counts.stored,
                "failed": counts.failed,
            }
            return TimeoutError(
                f"{len(rows)} of the first {want} answers stored after {timeout:.0f}s "
                f"(inference.first_samples_timeout_s); ledger: {ledger}"
            )

        wait_until(stored_enough, timeout_s=timeout, interval_s=0.5, what="the first answers", on_timeout=timed_out)
        seconds = time.monotonic() - handed_out[0] if handed_out else 0.0
        if counts.produced_tokens and seconds >= 1.0:  # (not when the answers were there at the first look)
            self.first_answers_pace = FirstAnswersPace(
                counts.produced_tokens / seconds, counts.produced_tokens, seconds
            )
        return self.gang.vocab_mapping(rows, self.vocab_texts)
