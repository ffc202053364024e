"""The job room: one config's whole run, from prompts to the exported, evaluated drafter.

Owns the training job (`training_job`: it builds the parts and runs the phases), what the job
reads before anything starts (`inputs`), the settings each part gets from the config
(`settings`), the training loop (`loop`), the commit point (`checkpointing`), the trainer
world's resume, restarts and resize (`recovery`), replicas and the store's master between steps
(`supervision`), the run's events (`events`), the end (`results`, `evaluation`, `calibration`,
its last lines: `summary`) and the progress reporter (`progress`). It wires the other rooms
together and is the only room that knows them all; on one CPU box the driver plans the box first
(`cluster.box.plan_box`).
"""

from cluster.job.progress import ProgressReporter, TrainingStats, eta
from cluster.job.results import JobFailed
from cluster.job.summary import summary
from cluster.job.training_job import TrainingJob

__all__ = ["JobFailed", "ProgressReporter", "TrainingStats", "TrainingJob", "eta", "summary"]
