"""What the job trains on and judges on: per-category caps on the training prompts, and the
extra evaluation sets, which must never share a prompt with the training data."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from cluster.config import ConfigError
from cluster.config_load import load_config
from cluster.data import check_eval_sets, load_prompts
from dspark.prompts import cap_per_category

ROOT = Path(__file__).resolve().parents[2]


def test_max_prompts_per_category_caps_each_category_with_a_spread_sample():
    full, _ = load_prompts(load_config(ROOT / "configs" / "local.yaml", ["data.max_prompts_per_category=null"]))
    capped, _ = load_prompts(load_config(ROOT / "configs" / "local.yaml", ["data.max_prompts_per_category=7"]))
    per_category = Counter(c.category for c in full)
    assert Counter(c.category for c in capped) == {k: min(n, 7) for k, n in per_category.items()}
    position = {c.id: i for i, c in enumerate(full)}
    assert [position[c.id] for c in capped] == sorted(position[c.id] for c in capped)  # kept in their order
    # Chosen by the ids' hashes, independently of file order: the same ones from a reversed list.
    assert cap_per_category(full[::-1], 7) == capped[::-1]
    # Spread over the category, where the file lists it template by template: the 24 coding
    # prompts kept by the local config open in more ways than the first 24's two templates.
    coding = [c for c in full if c.category == "coding"]
    assert len({c.prompt_messages[0]["content"].split()[0] for c in coding[:24]}) <= 2
    kept, _ = load_prompts(load_config(ROOT / "configs" / "local.yaml", []))
    assert len({c.prompt_messages[0]["content"].split()[0] for c in kept if c.category == "coding"}) >= 4


def test_category_caps_replace_the_common_cap_for_the_categories_they_name():
    full, _ = load_prompts(load_config(ROOT / "configs" / "local.yaml", ["data.max_prompts_per_category=null"]))
    per_category = Counter(c.category for c in full)
    capped, _ = load_prompts(
        load_config(
            ROOT / "configs" / "local.yaml",
            ["data.max_prompts_per_category=5", "data.category_caps={math: 2, magpie_chat: 30}"],
        )
    )
    expected = {k: min(n, {"math": 2, "magpie_chat": 30}.get(k, 5)) for k, n in per_category.items()}
    assert per_category["magpie_chat"] > 30 and Counter(c.category for c in capped) == expected
    # The same hash order as the common cap: a smaller cap keeps a subset of a larger one's picks.
    common, _ = load_prompts(load_config(ROOT / "configs" / "local.yaml", ["data.max_prompts_per_category=5"]))
    assert {c.id for c in capped if c.category == "math"} < {c.id for c in common if c.category == "math"}
    # Without a common cap only the named categories are capped.
    only, _ = load_prompts(
        load_config(
            ROOT / "configs" / "local.yaml", ["data.max_prompts_per_category=null", "data.category_caps={math: 2}"]
        )
    )
    assert Counter(c.category for c in only) == {**per_category, "math": 2}
    with pytest.raises(ConfigError, match=r"data\.category_caps\.math.*out of range"):
        load_config(ROOT / "configs" / "local.yaml", ["data.category_caps={math: 0}"])
    with pytest.raises(ConfigError, match=r"data\.category_caps.*'maths'"):
        load_prompts(load_config(ROOT / "configs" / "local.yaml", ["data.category_caps={maths: 2}"]))


def test_eval_sets_must_exist_and_never_overlap_training(tmp_path):
    cfg = load_config(ROOT / "configs" / "local.yaml", ["data.max_prompts_per_category=null"])
    train, _ = load_prompts(cfg)
    cfg.data.eval_sets = {"ood": "data/prompts/ood.jsonl"}
    check_eval_sets(cfg, train)  # the shipped OOD set is apart from the training prompts
    leaked = tmp_path / "leaked.jsonl"
    leaked.write_text(json.dumps({"id": "x1", "messages": train[3].prompt_messages}) + "\n")
    cfg.data.eval_sets = {"mine": str(leaked)}
    with pytest.raises(ConfigError, match=rf"data.eval_sets.mine.*x1.*{train[3].id}"):
        check_eval_sets(cfg, train)
    cfg.data.eval_sets = {"gone": str(tmp_path / "missing.jsonl")}
    with pytest.raises(ConfigError, match="data.eval_sets.gone.*does not exist"):
        check_eval_sets(cfg, train)


def saved_checkpoint(root: Path, ledger_state: dict) -> None:
    """A checkpoint whole enough for `CheckpointDir.latest()`, with this ledger state."""
    ckpt = root / "checkpoints" / "step-000001"
    (ckpt / "drafter").mkdir(parents=True)
    (ckpt / "trainer").mkdir()
    (ckpt / "meta.json").write_text(json.dumps({"step": 1, "world_size": 1, "record_rows": 0}))
    (ckpt / "ledger.json").write_text(json.dumps(ledger_state))
    (ckpt / "drafter" / "config.json").write_text("{}")
    (ckpt / "drafter" / "model.safetensors").write_bytes(b"x")
    (ckpt / "trainer" / "latest").write_text("global_step1")


def test_a_resume_whose_checkpoint_trained_other_prompts_is_refused(tmp_path):
    from cluster.data import ProducedSample, SampleLedger
    from cluster.job.recovery import check_resume_plan
    from cluster.store import SampleRef
    from cluster.training import CheckpointDir

    class Job:
        def __init__(self, *overrides, run="r"):
            self.cfg = load_config(
                ROOT / "configs" / "local.yaml",
                [f"output_dir={tmp_path}", f"run_name={run}", "logging.wandb_mode=disabled", *overrides],
            )
            self.run_dir = self.cfg.run_dir
            self.train_prompts, self.heldout = load_prompts(self.cfg)

        def check_resume_plan(self):
            return check_resume_plan(
                self.cfg,
                CheckpointDir(self.run_dir / "checkpoints"),
                {c.id for c in self.train_prompts},
                {c.id for c in self.heldout},
            )

    job = Job
    first = job("data.max_prompts_per_category=4", "data.epochs=2")
    ledger = SampleLedger(
        [{"id": c.id, "messages": c.prompt_messages} for c in first.train_prompts], epochs=2, reuse_across_epochs=True
    )
    handed = ledger.request_prompts("r0", 1000)
    ledger.report_produced("r0", [ProducedSample(p.uid, SampleRef(p.key, 5, (), 0)) for p in handed])
    for step in (1, 2):  # every sample of an epoch in one step, trained once it commits
        ledger.lease_step(step, ["g0"], 10**6)
    saved_checkpoint(first.run_dir, ledger.checkpoint_state(2))

    assert first.check_resume_plan() == first.run_dir / "checkpoints" / "step-000001"  # the same plan
    job("data.max_prompts_per_category=4", "data.epochs=3").check_resume_plan()  # a plan that only adds
    assert (
        job("data.max_prompts_per_category=4", "data.epochs=2", "trainer.resume=never").check_resume_plan() is None
    )  # fresh
    trained = {c.id for c in first.train_prompts}
    fewer = job("data.max_prompts_per_category=3", "data.epochs=2")
    dropped = sorted(f"{i}@{e}" for i in trained - {c.id for c in fewer.train_prompts} for e in (0, 1))
    with pytest.raises(
        ConfigError, match=rf"trained {len(dropped)} samples .*\(e\.g\. {dropped[0]}.*trainer\.resume=never"
    ):
        fewer.check_resume_plan()
    with pytest.raises(ConfigError, match=rf"trained {len(trained)} samples .*@1"):  # fewer epochs: epoch 1's
        job("data.max_prompts_per_category=4", "data.epochs=1").check_resume_plan()
    # Another held-out split: some trained prompts are now evaluated, and the message says so.
    resplit = job("data.max_prompts_per_category=4", "data.epochs=2", "data.split_seed=1")
    now_heldout = trained & {c.id for c in resplit.heldout}
    assert now_heldout
    with pytest.raises(ConfigError, match=rf"{len(now_heldout)} of their prompts are now held out"):
        resplit.check_resume_plan()
    with pytest.raises(ConfigError, match="trainer.resume.*no whole checkpoint"):
        job("trainer.resume=always", run="never-ran").check_resume_plan()
