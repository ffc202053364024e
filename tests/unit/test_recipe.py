"""The serving recipe shipped with a drafter: `serve.sh` run with a stand-in `vllm` that records
its arguments, and vLLM's own `SpeculativeConfig` built from the `--speculative-config` JSON it
received (CPU: vLLM parses the config for `dspark`, it executes it only on GPU)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from dspark.checkpoint import save_drafter
from dspark.recipe import model_card, write_recipe
from tests.helpers import make_drafter

pytest.importorskip("vllm")

EVALUATION = {
    "tau": 1.7, "macro_tau": 1.6, "num_prompts": 3, "lossless": True,
    "per_category": {"math": {"tau": 2.0, "num_prompts": 1, "per_position_acceptance": [0.6, 0.4]},
                     "coding": {"tau": 1.2, "num_prompts": 2, "per_position_acceptance": [0.2, 0.0]}},
    "percentiles": {"p10": 1.1, "p50": 1.5, "p90": 2.0, "bottom10_mean": 1.0, "top10_mean": 2.1},
    "settings": {"dtype": "float32", "temperature": 0.0, "num_speculative_tokens": 8, "max_new_tokens": 80},
}
TRAINING = {"target": "HuggingFaceTB/SmolLM2-135M-Instruct", "prompt_files": ["data/prompts/default.jsonl"],
            "train_prompts": 600, "heldout_prompts": 60, "categories": {"math": 300, "coding": 300}, "epochs": 2,
            "trained_samples": 1200, "steps": 40, "sampling": "temperature 0.0, up to 160 tokens"}


def served_config(drafter_dir, tmp_path, target=None):
    """Run serve.sh with `vllm` replaced by a script that writes its argv as JSON."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    argv_file = tmp_path / "argv.json"
    fake = bin_dir / "vllm"
    fake.write_text(f'#!/usr/bin/env python3\nimport json, sys\njson.dump(sys.argv[1:], open("{argv_file}", "w"))\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    if target:
        env["TARGET"] = str(target)
    subprocess.run([str(drafter_dir / "serve.sh"), "--max-model-len", "512"], check=True, env=env, timeout=30)
    argv = json.loads(argv_file.read_text())
    assert argv[0] == "serve" and argv[-2:] == ["--max-model-len", "512"]
    return argv[1], json.loads(argv[argv.index("--speculative-config") + 1])


@pytest.mark.parametrize("draft_vocab, method", [(None, "probabilistic"), (4000, "greedy")])
def test_serve_recipe_parses_in_vllm(tiny_target, tmp_path, draft_vocab, method):
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig

    drafter = make_drafter(tiny_target, block_size=8, draft_vocab_size=draft_vocab)
    drafter.config.verifier_name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"  # target.name: a public id
    final = save_drafter(drafter, tmp_path / "final")
    write_recipe(final, TRAINING, EVALUATION)
    assert os.access(final / "serve.sh", os.X_OK)

    target, spec = served_config(final, tmp_path)
    assert target == "HuggingFaceTB/SmolLM2-135M-Instruct"  # the recorded verifier, not a local path
    assert spec == {"model": str(final), "method": "dspark", "num_speculative_tokens": 8, "draft_sample_method": method}

    target, spec = served_config(final, tmp_path, target=tiny_target)  # TARGET= overrides, the drafter stays
    parsed = SpeculativeConfig(target_model_config=ModelConfig(model=target, max_model_len=512),
                               target_parallel_config=ParallelConfig(), **spec)
    assert parsed.method == "dspark" and parsed.num_speculative_tokens == 8
    assert parsed.draft_sample_method == method
    assert parsed.draft_model_config.hf_config.draft_vocab_size == (draft_vocab or 49152)


def test_model_card_states_what_was_measured(tiny_target, tmp_path):
    drafter = make_drafter(tiny_target, block_size=8, draft_vocab_size=4000)
    final = save_drafter(drafter, tmp_path / "final")
    card = model_card(json.loads((final / "config.json").read_text()), TRAINING, EVALUATION)
    assert "| math | 1 | 2.000 | 0.60 0.40 |" in card and "| coding | 2 | 1.200 | 0.20 0.00 |" in card
    assert "Macro τ over categories: 1.600" in card and "p10 1.100" in card
    assert "600 training prompts (coding 300, math 300)" in card
    assert '"draft_sample_method": "greedy"' in card  # reduced draft vocabulary
