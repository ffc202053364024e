"""Checks declared with the config's fields (cluster/config_fields.py): each names a real key,
and a value out of its range or choices is refused naming that key."""

from __future__ import annotations

import re

import pytest
from omegaconf import OmegaConf

from cluster.config import ROOT, ConfigError, JobConfig
from cluster.config_fields import CHOICES, RANGE, declared
from cluster.config_load import load_config


def test_every_declared_check_names_a_key_of_the_config():
    node = OmegaConf.structured(JobConfig(run_name="r"))
    ranges, choices = declared(JobConfig, RANGE), declared(JobConfig, CHOICES)
    assert {"trainer.lr", "transport.segment_mb", "topology.placement_timeout_s"} <= {k for k, _ in ranges}
    assert {"device", "drafter.mode", "data.eval_backend"} <= {k for k, _ in choices}
    for key, _ in ranges + choices:
        assert OmegaConf.select(node, key, default=KeyError) is not KeyError, key


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.zero_stage=4", r"`trainer.zero_stage`: 4 is out of range \(must be >= 0 and <= 3\)"),
        (
            "logging.wandb_mode=cloud",
            r"`logging.wandb_mode`: 'cloud' is not one of \('offline', 'online', 'disabled'\)",
        ),
    ],
)
def test_a_declared_check_refuses_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(ROOT / "configs" / "local.yaml", ["run_name=r", override])


def test_testing_hooks_are_refused_in_a_users_run_unless_asked_for():
    """`testing:` (faults, a slower trainer) is the suite's: a user's config with a hook set is
    refused, naming the key, unless `testing.enabled` or DSPARK_TESTING=1 asks for it."""
    from cluster.config import JobConfig
    from cluster.config_checks import check_testing
    from cluster.errors import ConfigError

    cfg = JobConfig(run_name="r")
    check_testing(cfg, environ={})  # no hook: nothing to refuse
    cfg.testing.replay_crash_on = ["dspark-0030"]
    with pytest.raises(ConfigError, match=r"`testing\.replay_crash_on`.*testing\.enabled=true"):
        check_testing(cfg, environ={})
    check_testing(cfg, environ={"DSPARK_TESTING": "1"})
    cfg.testing.enabled = True
    check_testing(cfg, environ={})
    cfg.testing.replay_crash_on, cfg.testing.enabled, cfg.testing.trainer_throttle_s = [], False, 0.5
    assert cfg.testing.hooks_set() == ["trainer_throttle_s"]
    with pytest.raises(ConfigError, match=r"`testing\.trainer_throttle_s`"):
        check_testing(cfg, environ={"DSPARK_TESTING": "0"})


@pytest.mark.parametrize(
    "override, key",
    [
        ("topology.groups.0.cpus_per_replica=-1", "topology.groups.0.cpus_per_replica"),
        ("topology.groups.0.gpus_per_node=-2", "topology.groups.0.gpus_per_node"),
        ("topology.groups.0.replay_samples_per_s=-0.5", "topology.groups.0.replay_samples_per_s"),
        ("topology.groups.0.trainer_nodes=0", "topology.groups.0.trainer_nodes"),
        ("capacity.rank_tokens_per_s=0", "capacity.rank_tokens_per_s"),
        ("topology.groups.0.cpus_per_trainer_rank=.nan", "topology.groups.0.cpus_per_trainer_rank"),
    ],
)
def test_a_bad_value_inside_a_list_of_sections_is_refused_naming_its_path(override, key):
    """The range checks walk lists of sections (`topology.groups[*]`) as an override names them:
    a negative CPU count fails here, before any actor starts, not inside Ray's placement."""
    with pytest.raises(ConfigError, match=rf"config error at `{re.escape(key)}`"):
        load_config(ROOT / "configs" / "local.yaml", ["run_name=r", override])


def test_the_range_walk_names_every_group_of_a_list():
    from cluster.config import GroupConfig
    from cluster.config_fields import declared_values

    cfg = JobConfig(run_name="r")
    cfg.topology.groups = [GroupConfig(name="a"), GroupConfig(name="b", cpus_per_replica=2.5)]
    values = {key: value for key, _, value in declared_values(cfg, RANGE)}
    assert values["topology.groups.0.cpus_per_replica"] == 1.0 and values["topology.groups.1.cpus_per_replica"] == 2.5
    assert set(k for k, _ in declared(JobConfig, RANGE)) <= set(values)  # the class walk's keys, every one
