"""The serving recipe shipped with a drafter: `serve.sh` run with a stand-in `vllm` that records
its arguments, and vLLM's own `SpeculativeConfig` built from the `--speculative-config` JSON it
received (CPU: vLLM parses the config for `dspark`, it executes it only on GPU). The recipe's
names are checked against the installed vLLM's own types, and the reason probabilistic drafting
is allowed with a reduced draft vocabulary (vLLM's dspark speculator maps the draft distribution
into the target vocabulary through d2t) against its source, so a vLLM upgrade that drops it
fails here instead of serving a reduced-vocabulary drafter wrongly."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from dspark.checkpoint import save_drafter
from dspark.recipe import RECIPES, model_card, speculative_config, write_recipe
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


def served_config(drafter_dir, tmp_path, target=None, script=None):
    """Run serve.sh (or `script DRAFTER`) with `vllm` replaced by a script that writes its argv as JSON."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    argv_file = tmp_path / "argv.json"
    fake = bin_dir / "vllm"
    fake.write_text(f'#!/usr/bin/env python3\nimport json, sys\njson.dump(sys.argv[1:], open("{argv_file}", "w"))\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    if target:
        env["TARGET"] = str(target)
    cmd = [str(script), str(drafter_dir)] if script else [str(drafter_dir / "serve.sh")]
    subprocess.run([*cmd, "--max-model-len", "512"], check=True, env=env, timeout=60)
    argv = json.loads(argv_file.read_text())
    assert argv[0] == "serve" and argv[-2:] == ["--max-model-len", "512"]
    return argv[1], json.loads(argv[argv.index("--speculative-config") + 1])


RECIPE = {"method": "dspark", "num_speculative_tokens": 8, "draft_sample_method": "probabilistic",
          "rejection_sample_method": "block"}


def test_recipe_names_are_vllms():
    """Every value the recipes use is one the pinned vLLM's config accepts, and the reason a
    reduced draft vocabulary may still draft probabilistically is in its dspark speculator."""
    import inspect
    import typing

    from vllm.config.speculative import DraftSampleMethod, RejectionSampleMethod
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

    for draft, rejection, _ in RECIPES.values():
        assert draft in typing.get_args(DraftSampleMethod) and rejection in typing.get_args(RejectionSampleMethod)
    # The draft-vocabulary logits are scattered into target-vocabulary columns (the rest -inf)
    # before they are sampled and cached for the rejection sampler.
    src = inspect.getsource(DSparkSpeculator._sample_logits)
    assert "_d2t_scatter_index" in src and "index_copy_" in src


def test_recipe_per_method():
    cfg = {"speculators_model_type": "dspark", "block_size": 8, "draft_vocab_size": 4000,
           "transformer_layer_config": {"vocab_size": 49152},
           "speculators_config": {"proposal_methods": [{"speculative_tokens": 8}]}}
    assert speculative_config(cfg, "d") == {"model": "d", **RECIPE}
    assert speculative_config(cfg, "d", "dflash") == {  # vLLM's CPU (V1) runner: no block verification
        "model": "d", "method": "dflash", "num_speculative_tokens": 8, "draft_sample_method": "greedy",
        "rejection_sample_method": "standard"}
    with pytest.raises(ValueError, match="no serving recipe"):
        speculative_config(cfg, "d", "eagle3")
    cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 9
    with pytest.raises(ValueError, match="9 speculative tokens from a block of 8"):
        speculative_config(cfg, "d")


@pytest.mark.parametrize("draft_vocab", [None, 4000])
def test_serve_recipe_parses_in_vllm(tiny_target, tmp_path, draft_vocab):
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig

    drafter = make_drafter(tiny_target, block_size=8, draft_vocab_size=draft_vocab)
    drafter.config.verifier_name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"  # target.name: a public id
    final = save_drafter(drafter, tmp_path / "final")
    write_recipe(final, TRAINING, EVALUATION)
    assert os.access(final / "serve.sh", os.X_OK)

    target, spec = served_config(final, tmp_path)
    assert target == "HuggingFaceTB/SmolLM2-135M-Instruct"  # the recorded verifier, not a local path
    assert spec == {"model": str(final), **RECIPE}  # a reduced draft vocabulary too: vLLM maps it (d2t)

    target, spec = served_config(final, tmp_path, target=tiny_target)  # TARGET= overrides, the drafter stays
    parsed = SpeculativeConfig(target_model_config=ModelConfig(model=target, max_model_len=512),
                               target_parallel_config=ParallelConfig(), **spec)
    assert parsed.method == "dspark" and parsed.num_speculative_tokens == 8
    assert parsed.draft_sample_method == "probabilistic" and parsed.rejection_sample_method == "block"
    assert parsed.draft_model_config.hf_config.draft_vocab_size == (draft_vocab or 49152)


def test_model_card_states_what_was_measured(tiny_target, tmp_path):
    drafter = make_drafter(tiny_target, block_size=8, draft_vocab_size=4000)
    final = save_drafter(drafter, tmp_path / "final")
    card = model_card(json.loads((final / "config.json").read_text()), TRAINING, EVALUATION)
    assert "| math | 1 | 2.000 | 0.60 0.40 |" in card and "| coding | 2 | 1.200 | 0.20 0.00 |" in card
    assert "Macro τ over categories: 1.600" in card and "p10 1.100" in card
    assert "600 training prompts (coding 300, math 300)" in card
    assert '"draft_sample_method": "probabilistic", "rejection_sample_method": "block"' in card
    assert "probabilistic drafting + block rejection (draft vocabulary 4000 of the target's 49152)" in card
    assert "through d2t" in card  # why a reduced vocabulary still drafts probabilistically
    assert "Lossless (greedy speculative output identical to the target's, token for token, against the target's own" \
        " greedy output): True." in card
    served = model_card(json.loads((final / "config.json").read_text()), TRAINING, {**EVALUATION, "backend": "vllm",
                        "lossless": None, "settings": {**EVALUATION["settings"], "method": "dspark"}})
    assert "Lossless" not in served  # not checked: not claimed
    assert "Not worth serving" not in card  # no quality verdict given: none claimed


def test_model_card_says_when_a_drafter_is_not_worth_serving(tiny_target, tmp_path):
    from cluster.job.quality import assess

    final = save_drafter(make_drafter(tiny_target, block_size=8), tmp_path / "final")
    verdict = assess(192, 276, 1.055, "time_budget", 480)
    card = model_card(json.loads((final / "config.json").read_text()),
                      {**TRAINING, "quality": {"worth_serving": False, "reasons": verdict.reasons,
                                               "advice": verdict.advice}}, EVALUATION)
    head = card.split("## Training data")[0]
    assert "**Not worth serving as trained:** it trained 192 samples, 70% of one epoch" in head
    assert "raise trainer.time_budget_s (was 480)" in head


def test_scripts_serve_writes_a_missing_recipe(tiny_target, tmp_path):
    """scripts/serve.sh on a checkpoint exported without its recipe: serve.sh is written from the
    checkpoint's config.json, then run."""
    drafter = make_drafter(tiny_target, block_size=8, draft_vocab_size=4000)
    drafter.config.verifier_name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    final = save_drafter(drafter, tmp_path / "step")
    assert not (final / "serve.sh").exists()
    root = Path(__file__).resolve().parents[2]
    target, spec = served_config(final, tmp_path, script=root / "scripts" / "serve.sh")
    assert target == "HuggingFaceTB/SmolLM2-135M-Instruct" and spec == {"model": str(final), **RECIPE}
    assert os.access(final / "serve.sh", os.X_OK)
