"""Bad inputs fail at once, before any actor starts, with a message that names the cause: the
config key, the file and line, the prompt file's line; never a bare traceback from deep inside
a library, never a hang."""

from __future__ import annotations

import json
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from cluster.config import ConfigError, JobConfig, load_config
from cluster.config_checks import check_against_target
from cluster.config_fields import RANGE, declared

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "configs" / "local.yaml"


@pytest.mark.parametrize("override, message", [
    ("trainer.lr=-0.001", r"`trainer\.lr`: -0\.001 is out of range \(must be > 0\)"),
    ("trainer.batch_tokens=0", r"`trainer\.batch_tokens`: 0 is out of range"),
    ("trainer.checkpoint_interval=0", r"`trainer\.checkpoint_interval`"),
    ("data.epochs=0", r"`data\.epochs`"),
    ("trainer.time_budget_s=-60", r"`trainer\.time_budget_s`: -60\.0 is out of range \(must be > 0 and <= 2592000\)"),
    ("data.heldout_fraction=1.0", r"`data\.heldout_fraction`: 1\.0 is out of range \(must be > 0 and < 1: the job evaluates"),
    ("trainer.zero_stage=7", r"`trainer\.zero_stage`: 7 is out of range \(must be >= 0 and <= 3\)"),
    ("sampling.max_tokens=1024", r"`sampling\.max_tokens`: 1024 leaves no room for a prompt within target\.max_model_len=1024"),
    ("run_name=../escape", r"`run_name`: '\.\./escape' must be one folder name"),
    ("run_name=a/b", r"`run_name`"),
    ("transport.master_port=70000", r"`transport\.master_port`"),
    ("sampling.top_p=0", r"`sampling\.top_p`"),
    ("data.max_failed_fraction=2", r"`data\.max_failed_fraction`"),
    ("drafter.num_anchors=0", r"`drafter\.num_anchors`"),
])
def test_bad_input_config_value_names_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(LOCAL, [override])


@pytest.mark.parametrize("override, message", [
    ("data.epochs=1000", r"`data\.epochs`: 1000 is out of range \(must be >= 1 and <= 100: "),
    ("trainer.time_budget_s=.inf", r"`trainer\.time_budget_s`: inf is not a finite number \(must be > 0 and <= 2592000\)"),
    ("trainer.data_timeout_s=1e9", r"`trainer\.data_timeout_s`: 1000000000\.0 is out of range \(must be > 0 and <= 86400\)"),
    ("inference.generation_timeout_s=.inf", r"`inference\.generation_timeout_s`: inf is not a finite number"),
    ("autoscaler.cooldown_s=-1", r"`autoscaler\.cooldown_s`: -1\.0 is out of range \(must be >= 0 and <= 86400\)"),
    ("trainer.lr=.nan", r"`trainer\.lr`: nan is not a finite number"),
    ("data.heldout_fraction=0", r"`data\.heldout_fraction`: 0\.0 is out of range \(must be > 0 and < 1: the job evaluates "
                                r"the drafter on the held-out prompts\)"),
])
def test_bad_input_unbounded_values_are_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(LOCAL, [override])


def test_every_wait_and_the_epochs_declare_an_upper_bound():
    """A new timeout, delay or interval (a `*_s` field that is not a rate) without a bound fails
    here: `.inf` or a typo of a few zeros would hide the hang it is there to catch."""
    def keys(cls, prefix=""):
        for f in fields(cls):
            section = f.default_factory() if f.default_factory is not MISSING else None
            yield from keys(type(section), f"{prefix}{f.name}.") if is_dataclass(section) else [f"{prefix}{f.name}"]

    bounded = {key for key, r in declared(JobConfig, RANGE) if r.hi is not None}
    waits = {k for k in keys(JobConfig) if k.endswith("_s") and not k.endswith("_per_s")}
    assert waits and waits | {"data.epochs"} <= bounded, sorted(waits - bounded)


def test_bad_input_config_file_names_the_file_and_line(tmp_path):
    listed = tmp_path / "list.yaml"
    listed.write_text("- run_name: x\n- device: cpu\n")
    with pytest.raises(ConfigError, match=r"list\.yaml: the top level must be a mapping of sections .* not a list"):
        load_config(listed)
    broken = tmp_path / "broken.yaml"
    broken.write_text("run_name: x\ntrainer:\n  lr: [1, 2\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml: line \d+, column \d+: not valid YAML"):
        load_config(broken)
    with pytest.raises(ConfigError, match=r"missing\.yaml: No such file"):
        load_config(tmp_path / "missing.yaml")


def test_bad_input_against_the_target_names_the_key():
    smol = SimpleNamespace(num_hidden_layers=30, vocab_size=49152, max_position_embeddings=8192)
    for override, key in [("target.aux_layer_ids=[2,8,31]", "target.aux_layer_ids"),
                          ("target.aux_layer_ids=[2,2]", "target.aux_layer_ids"),
                          ("drafter.draft_vocab_size=60000", "drafter.draft_vocab_size"),
                          ("drafter.mask_token_id=49152", "drafter.mask_token_id"),
                          ("target.max_model_len=16384", "target.max_model_len")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            check_against_target(load_config(LOCAL, [override, "sampling.max_tokens=160"]), smol)
    check_against_target(load_config(LOCAL), smol)  # the shipped config is fine


def test_bad_input_prompts_file_names_the_line(tmp_path):
    from cluster.data import load_prompts
    from dspark.prompts import read_conversations

    f = tmp_path / "prompts.jsonl"
    f.write_bytes(json.dumps({"id": "a", "prompt": "hello"}).encode() + b"\n" + b'{"id": "b", "prompt": "caf\xe9"}\n'
                  + b"not json\n")
    convs, report = read_conversations(f)
    assert [c.id for c in convs] == ["a"]
    assert report.bad[0][0] == 2 and "not UTF-8: byte 0xe9" in report.bad[0][1] and report.bad[1][0] == 3
    assert "line 2: not UTF-8" in report.summary()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("not json\n")
    with pytest.raises(ValueError, match=r"no training prompts in data\.prompts=.*empty\.jsonl"):
        load_prompts(load_config(LOCAL, [f"data.prompts=[{empty}]"]))


def test_a_failure_is_named_by_its_own_last_line():
    from cluster.errors import cause_of

    traceback = "Traceback (most recent call last):\n  File \"x.py\", line 3\nValueError: prompt p7 is too long\n\n"
    assert cause_of(RuntimeError(traceback)) == "ValueError: prompt p7 is too long"
    assert cause_of(RuntimeError("  \n ")) == "RuntimeError"  # no text: the type (the old code raised IndexError)

    class RemoteFailure(Exception):  # what Ray's RayTaskError carries: the actor's own exception
        cause = KeyError("sample g0/p3 missing")

    assert cause_of(RemoteFailure("ray's traceback text")) == "'sample g0/p3 missing'"
    assert len(cause_of(RuntimeError("x" * 1000), 300)) == 300
