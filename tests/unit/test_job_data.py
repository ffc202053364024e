"""What the job trains on and judges on: per-category caps on the training prompts, and the
extra evaluation sets, which must never share a prompt with the training data."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from cluster.config import ConfigError, load_config
from cluster.job import check_eval_sets, load_prompts
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
