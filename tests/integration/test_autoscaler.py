"""The autoscaler on a real local run with the replay backend (no target model): throttled
producers starve the trainer → a replica is added; a throttled trainer lets the queue grow →
a replica is removed; a throttled trainer that may grow gets a rank at a checkpoint; every prompt
is trained exactly once throughout. All three are `slow` (the test suite's time budget: its
default run keeps one whole job, tests/integration/test_job.py)."""

from __future__ import annotations

import pytest

from cluster.config_load import load_config
from tests.helpers import REPLAY_JOB_PINS

pytestmark = pytest.mark.integration


def run(tmp_path, replay_dir, name, overrides):
    from cluster.job import TrainingJob

    base = [
        "run_name=" + name,
        f"output_dir={tmp_path}",
        "inference.backend=replay",
        f"inference.replay_dir={replay_dir}",
        "autoscaler.enabled=true",
        "autoscaler.interval_s=1",
        "autoscaler.scale_up_delay_s=2",
        "autoscaler.scale_down_delay_s=2",
        "autoscaler.cooldown_s=3",
        "drafter.draft_vocab_size=null",
        "drafter.num_anchors=4",
        "drafter.markov_rank=16",
        "trainer.batch_tokens=600",
        "trainer.checkpoint_interval=5",
        "data.eval_limit=1",
        "data.eval_max_new_tokens=8",
        "logging.wandb_mode=disabled",
        "logging.progress_interval_s=3",
        "transport.segment_mb=64",
        "topology.groups.0.max_replicas=2",
        "data.epochs=1",
        *REPLAY_JOB_PINS,
    ]
    cfg = load_config("configs/local.yaml", base + overrides)
    result = TrainingJob(cfg).run()
    return result, result["autoscaler"]


@pytest.mark.slow  # the suite's 15 minutes: the default run keeps one whole job (test_job.py)
def test_starving_trainer_gets_a_replica(ray_cluster, smol_target, replay_dir, tmp_path):
    # Enough prompts that the starving phase outlasts the trainer's start-up, during which the
    # first ~48 samples pile up to the high watermark.
    result, history = run(
        tmp_path, replay_dir, "scale-up", ["data.max_prompts=100", "inference.replay_samples_per_s=2"]
    )
    applied = [h["action"] for h in history if h["action"].startswith("applied:")]
    assert "applied:add_replica" in applied, history
    assert result["exactly_once"]["per_epoch"] == {"0": 100} and result["groups"]["g0"]["replicas"] == 2


@pytest.mark.slow
def test_throttled_trainer_loses_a_replica(ray_cluster, smol_target, replay_dir, tmp_path):
    # Two fast producers, a slow trainer and a small store: the queue passes the high watermark.
    result, history = run(
        tmp_path,
        replay_dir,
        "scale-down",
        [
            "data.max_prompts=60",
            "topology.groups.0.inference_replicas=2",
            "testing.trainer_throttle_s=1.0",
            "transport.segment_mb=16",
        ],
    )
    applied = [h["action"] for h in history if h["action"].startswith("applied:")]
    assert "applied:remove_replica" in applied, history
    assert result["exactly_once"]["per_epoch"] == {"0": 60}


@pytest.mark.slow
def test_slow_trainer_grows_at_a_checkpoint(ray_cluster, smol_target, replay_dir, tmp_path):
    # Fast producers, a throttled single-rank trainer that may grow to two ranks: the plan adds a
    # rank; the resize checkpoints, restarts the DeepSpeed group with world size 2 and resumes.
    result, history = run(
        tmp_path,
        replay_dir,
        "grow",
        [
            "data.max_prompts=120",
            "topology.groups.0.inference_replicas=2",
            "topology.groups.0.max_trainer_ranks=2",
            "testing.trainer_throttle_s=0.5",
        ],
    )
    applied = [h["action"] for h in history if h["action"].startswith("applied:")]
    assert "applied:grow_trainer" in applied, history
    assert any("trainer resized {'g0': 1}->{'g0': 2}" in e for e in result["events"]), result["events"]
    assert result["world"] == {"g0": 2}
    assert result["exactly_once"]["per_epoch"] == {"0": 120} and result["exactly_once"]["failed"] == []
    assert result["exactly_once"]["trained_by_group"] == {"g0": 120}
