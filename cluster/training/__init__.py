"""The training room: the drafter learning.

Owns one DeepSpeed trainer rank (`trainer_rank`, a Ray actor; set up from `rank_setup`), the gang of every group's ranks
as one data-parallel world (`trainer_gang`), the epoch budget that fits the plan to a time
budget (`budget`, pure: clock injected) and the checkpoint directory (`checkpoints`).
"""

from cluster.training.budget import EpochPlanner, Plan
from cluster.training.checkpoints import CheckpointDir
from cluster.training.rank_setup import (
    TrainerSettings,
    deepspeed_config,
    drafter_config,
    load_checkpoints_without_code,
    vocab_mapping_from,
)
from cluster.training.step_result import StepResult
from cluster.training.trainer_gang import TrainerFailure, TrainerGang
from cluster.training.trainer_rank import TrainerRank

__all__ = [
    "CheckpointDir",
    "EpochPlanner",
    "Plan",
    "StepResult",
    "TrainerFailure",
    "TrainerGang",
    "TrainerRank",
    "TrainerSettings",
    "deepspeed_config",
    "drafter_config",
    "load_checkpoints_without_code",
    "vocab_mapping_from",
]
