"""A target whose architecture ships as code in its own directory (`auto_map`, like Kimi's
checkpoints), built locally (`tests.families.build_remote_code_target`): no network.

Without `target.trust_remote_code` the job refuses it before any actor starts, naming the key,
and none of its code runs (the config module leaves a marker when imported). With it, every part
that reads the target does so the same way: the driver's checks, vLLM (its Transformers backend
runs the unknown architecture and extracts its hidden states), the drafter's config, the
trainer's tokenizer, the evaluation (with its own --trust-remote-code: the flag recorded in the
exported checkpoint is not consent) and the serving recipe (`--trust-remote-code`).
"""

from __future__ import annotations

import json

import pytest
import torch

from cluster.config import ROOT, ConfigError, SamplingConfig
from cluster.config_load import load_config
from cluster.inference import InferenceActor, InferenceSettings
from cluster.target import read_target
from dspark import evaluate
from dspark.chat import ChatFormat, render_prompt
from dspark.checkpoint import save_drafter
from dspark.config import DSparkConfig
from dspark.decoder import target_generate
from dspark.model import DSparkDrafter
from dspark.recipe import write_recipe
from dspark.samples import read_sample
from dspark.targets import hidden_states_for, load_target, load_target_config
from tests.families import build_remote_code_target
from tests.helpers import PERSONA_TEMPLATE, eager_target

pytestmark = pytest.mark.integration

PROMPT = {
    "id": "r0",
    "category": "chat",
    "messages": [{"role": "user", "content": "Name three colours of the rainbow."}],
}


@pytest.fixture(scope="module")
def remote_target(smol_target, tmp_path_factory):
    return build_remote_code_target(tmp_path_factory.mktemp("remote") / "tiny-remote", smol_target)


@pytest.fixture
def marker(tmp_path, monkeypatch):
    path = tmp_path / "remote-code-ran"
    monkeypatch.setenv("DSPARK_REMOTE_CODE_MARKER", str(path))
    return path


def test_remote_code_refused_without_trust(remote_target, marker):
    cfg = load_config(ROOT / "configs" / "local.yaml", [f"target.path={remote_target}"])
    with pytest.raises(ConfigError, match=r"target\.trust_remote_code.*auto_map"):
        read_target(cfg)
    with pytest.raises(ValueError, match="trust_remote_code"):
        DSparkConfig.from_target(remote_target)
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_target_config(remote_target)
    assert not marker.exists(), "the target's code ran without target.trust_remote_code"


@pytest.mark.slow  # a whole engine start; the refusal without trust stays in the default run
def test_remote_code_target_with_trust(ray_cluster, remote_target, marker, tmp_path):
    ray = ray_cluster
    cfg = load_config(
        ROOT / "configs" / "local.yaml", [f"target.path={remote_target}", "target.trust_remote_code=true"]
    )
    facts = read_target(cfg)
    assert marker.exists() and type(facts.config).__name__ == "TinyRemoteConfig"

    dcfg = DSparkConfig.from_target(remote_target, trust_remote_code=True, num_layers=1, block_size=4, markov_rank=16)
    assert dcfg.target_trust_remote_code and dcfg.hidden_size == facts.config.hidden_size

    # vLLM runs the unknown architecture (Transformers backend) and extracts its states; the
    # replica renders the prompt with the configured chat format.
    chat = ChatFormat(PERSONA_TEMPLATE, {"persona": "You are terse."})
    settings = InferenceSettings(
        eager_target(remote_target, dtype="float32", max_model_len=512, trust_remote_code=True),
        dcfg.extract_layer_ids,
        "remote/g0",
        sampling=SamplingConfig(max_tokens=16),
        backend="file",
        file_dir=str(tmp_path / "hs"),
        chat=chat,
    )
    actor = ray.remote(num_cpus=1)(InferenceActor).remote(settings)
    try:
        [produced] = ray.get(actor.process.remote([PROMPT]), timeout=300)
    finally:
        ray.kill(actor)
    assert produced.error is None, produced.error
    model, tok = load_target(remote_target, torch.float32, trust_remote_code=True)
    ids = render_prompt(tok, PROMPT["messages"], chat)
    assert produced.prompt_tokens == len(ids) != len(render_prompt(tok, PROMPT["messages"]))
    assert produced.response_ids == target_generate(model, ids, 16, {tok.eos_token_id})
    sample = read_sample(produced.path)
    want = hidden_states_for(model, sample.token_ids, dcfg.extract_layer_ids)
    cos = torch.nn.functional.cosine_similarity(
        sample.hidden_states.double().flatten(1), want.double().flatten(1), dim=-1
    )
    assert float(cos.min()) >= 0.999, cos

    # Exported, the checkpoint says how to read the target again: evaluation and recipe follow it.
    dcfg.chat_format = chat.record(tok)
    drafter = DSparkDrafter(dcfg)
    drafter.load_target_weights(remote_target)
    final = save_drafter(drafter, tmp_path / "final")
    assert json.loads((final / "config.json").read_text())["dspark_cluster"]["target_trust_remote_code"] is True
    write_recipe(final, {}, {})
    # the recipe says the target needs remote code, and leaves the flag to the user (a comment, not the command)
    serve = (final / "serve.sh").read_text()
    assert "--trust-remote-code" in serve
    assert not [
        line for line in serve.splitlines() if "--trust-remote-code" in line and not line.lstrip().startswith("#")
    ]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps(PROMPT) + "\n")
    result = evaluate.evaluate(
        evaluate.parse_args(
            [
                "--target",
                str(remote_target),
                "--drafter",
                str(final),
                "--prompts",
                str(prompts),
                "--json",
                str(tmp_path / "e.json"),
                "--max-new-tokens",
                "16",
                "--trust-remote-code",
            ]
        )
    )
    assert result["lossless"] is True and result["requests"][0]["prompt_tokens"] == len(ids)
