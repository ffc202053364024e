"""The box room: on one CPU box, what the job trains in its time budget, chosen before anything
is placed (`box_plan.enabled`).

Owns the pure plan (`plan`: prompts per category, answer length and the core split from the
machine's paces; on one box the inference/training ratio is a split of its cores), the probe
of this machine's paces (`machine_paces`), the paces kept for later runs on it (`kept_paces`)
and the plan applied to the job's config (`apply`: `plan_box`, which the driver calls before
the job starts), and its second look once the job's replica has answered (`revision`).
It reads the config, the prompts (`cluster.data`) and the target (`cluster.target`); the job's
driver plans, the job's loop takes the second look (`cluster.job.plan_revision`).
"""

from cluster.box.apply import box_unfit, plan_box
from cluster.box.machine_paces import probe_paces, probe_trainer
from cluster.box.plan import (
    BoxPlan,
    Choices,
    EvaluationFit,
    Paces,
    Workload,
    choose_plan,
    fit_evaluation,
    startup_seconds,
)
from cluster.box.revision import Revision, prompts_beyond, revise_prompts

__all__ = [
    "BoxPlan",
    "Choices",
    "EvaluationFit",
    "Paces",
    "Revision",
    "Workload",
    "box_unfit",
    "choose_plan",
    "fit_evaluation",
    "plan_box",
    "probe_paces",
    "probe_trainer",
    "prompts_beyond",
    "revise_prompts",
    "startup_seconds",
]
