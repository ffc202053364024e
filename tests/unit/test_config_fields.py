"""Checks declared with the config's fields (cluster/config_fields.py): each names a real key,
and a value out of its range or choices is refused naming that key."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from cluster.config import ROOT, ConfigError, JobConfig, load_config
from cluster.config_fields import CHOICES, RANGE, declared


def test_every_declared_check_names_a_key_of_the_config():
    node = OmegaConf.structured(JobConfig(run_name="r"))
    ranges, choices = declared(JobConfig, RANGE), declared(JobConfig, CHOICES)
    assert {"trainer.lr", "transport.segment_mb", "topology.placement_timeout_s"} <= {k for k, _ in ranges}
    assert {"device", "drafter.mode", "data.eval_backend"} <= {k for k, _ in choices}
    for key, _ in ranges + choices:
        assert OmegaConf.select(node, key, default=KeyError) is not KeyError, key


@pytest.mark.parametrize("override, message", [
    ("trainer.zero_stage=4", r"`trainer.zero_stage`: 4 is out of range \(must be >= 0 and <= 3\)"),
    ("logging.wandb_mode=cloud", r"`logging.wandb_mode`: 'cloud' is not one of \('offline', 'online', 'disabled'\)"),
])
def test_a_declared_check_refuses_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(ROOT / "configs" / "local.yaml", ["run_name=r", override])
