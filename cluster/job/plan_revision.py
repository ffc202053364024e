"""`PlanRevision`: the box plan's second look (`cluster.box.revision`), applied to the job once
its first answers are in: fewer prompts where the replica it really has (tensor parallel, the
threads it gets, a long start-up) cannot train the planned ones often enough. The prompts left
out of the plan leave the ledger (`SampleLedger.drop_prompts`), the decision goes to the job's
log, its events and result.json's `plan.revision`."""

from __future__ import annotations

import logging
import time

from cluster.box import prompts_beyond, revise_prompts
from cluster.config import JobConfig
from cluster.data import LedgerClient
from cluster.job.events import EventLog

log = logging.getLogger("dspark.job")


class PlanRevision:
    def __init__(
        self,
        cfg: JobConfig,
        plan: dict,
        train_prompts: list,
        ledger: LedgerClient,
        deadline: float,
        events: EventLog,
        clock=time.monotonic,
    ) -> None:
        """`plan`: the record `plan_box` returned (the revision is added to it); `deadline`: when
        training ends, on `clock`."""
        self.cfg, self.plan, self.train_prompts, self.ledger = cfg, plan, train_prompts, ledger
        self.deadline, self.events, self.clock = deadline, events, clock

    def after_first_answers(self, pace) -> None:
        """`pace`: the replicas' `FirstAnswersPace` (None: not measured, the plan stands)."""
        if pace is None:
            self.plan["revision"] = {"revised": False, "why": "the first answers were there at once: no pace measured"}
            return
        cfg, box = self.cfg, self.cfg.box_plan
        time_left = self.deadline - self.clock()
        revision = revise_prompts(
            self.plan,
            pace.tok_s,
            pace.tokens,
            time_left,
            cfg.trainer.batch_tokens,
            cfg.data.epochs,
            tuple(box.prompts_per_category),
            box.target_epochs,
        )
        measured = {
            "generation_tok_s": round(pace.tok_s, 1),
            "over_s": round(pace.seconds, 1),
            "time_left_s": round(time_left, 1),
        }
        if revision is None:
            self.plan["revision"] = {"revised": False, "measured": measured}
            log.info(
                "box_plan: the plan stands at the first answers (the replica at %.0f tok/s, %.0f s of training left)",
                pace.tok_s,
                time_left,
            )
            return
        candidates = prompts_beyond(
            self.train_prompts, revision.prompts_per_category, cfg.data.split_seed, cfg.data.category_caps
        )
        dropped = self.ledger.drop_prompts(candidates)
        self.plan["revision"] = {
            "revised": True,
            "measured": measured,
            "prompts_per_category": revision.prompts_per_category,
            "expected_epochs": revision.expected_epochs,
            "planned_epochs": revision.planned_epochs,
            "dropped_prompts": len(dropped),
            "kept_handed_out": len(candidates) - len(dropped),
            "reason": revision.reason,
        }
        self.events.add(
            f"box_plan revised at the first answers: {len(dropped)} prompts left out (a cap of "
            f"{revision.prompts_per_category} a category; {len(candidates) - len(dropped)} more were already handed "
            f"out and stay): {revision.reason}",
            logging.WARNING,
        )
