"""The job room: one config's whole run, from prompts to the exported, evaluated drafter.

Owns the training job (`training_job`) and its progress reporter (`progress`); it wires the
other rooms together and is the only room that knows them all.
"""

from cluster.job.progress import ProgressReporter, TrainingStats, eta
from cluster.job.training_job import JobFailed, TrainingJob, check_eval_sets, load_prompts

__all__ = ["JobFailed", "ProgressReporter", "TrainingJob", "TrainingStats", "check_eval_sets", "eta", "load_prompts"]
