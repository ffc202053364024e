"""The job room: one config's whole run, from prompts to the exported, evaluated drafter.

Owns the training job (`training_job`: its state and phases), the settings each part gets
from the config (`settings`), the training loop (`loop`), the commit point (`checkpointing`),
resume, restarts and resize (`recovery`), the end (`results`), the progress reporter
(`progress`) and, on one CPU box, the probe of its paces and the plan applied before anything is
placed (`box`, `machine_paces`). It wires the other rooms together and is the only room that knows them all.
"""

from cluster.job.box import plan_box
from cluster.job.progress import ProgressReporter, TrainingStats, eta
from cluster.job.results import JobFailed
from cluster.job.training_job import TrainingJob

__all__ = ["JobFailed", "ProgressReporter", "TrainingJob", "TrainingStats", "eta", "plan_box"]
