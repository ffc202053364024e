"""vLLM's speculators-config reader accepts our config.json (parse only: vLLM executes DSpark
only on its GPU model runner)."""

from __future__ import annotations

import json

import pytest

from dspark.checkpoint import save_drafter
from tests.helpers import eager_target, make_drafter

pytest.importorskip("vllm")


def test_vllm_reads_dspark_config(tiny_target, tmp_path):
    from vllm.transformers_utils.config import maybe_override_with_speculators
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    drafter = make_drafter(tiny_target, block_size=8, draft_vocab_size=4000)
    save_drafter(drafter, tmp_path / "d")
    model, _tok, spec = maybe_override_with_speculators(str(tmp_path / "d"), None, trust_remote_code=False)
    assert model == str(tiny_target)
    assert spec["method"] == "dspark"
    assert spec["num_speculative_tokens"] == 8  # sample_from_anchor: every slot drafts
    hf = SpeculatorsConfig.from_pretrained(str(tmp_path / "d"))
    cfg = drafter.config
    assert hf.architectures == ["Qwen3DSparkModel"]
    assert hf.sample_from_anchor is True and hf.dspark_bonus_anchor is False
    assert hf.eagle_aux_hidden_state_layer_ids == cfg.aux_layer_ids
    assert hf.target_layer_ids == [i - 1 for i in cfg.aux_layer_ids]
    assert (hf.markov_rank, hf.markov_head_type, hf.block_size) == (cfg.markov_rank, "vanilla", 8)
    assert hf.mask_token_id == cfg.mask_token_id and hf.draft_vocab_size == 4000
    assert hf.enable_confidence_head and hf.confidence_head_with_markov
    assert hf.num_hidden_layers == cfg.num_layers and hf.hidden_size == cfg.hidden_size


def test_convention_keys_are_explicit(tiny_target, tmp_path):
    """vLLM defaults sample_from_anchor to False when absent: that would shift every draft slot."""
    save_drafter(make_drafter(tiny_target), tmp_path / "d")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    for key in (
        "sample_from_anchor",
        "mask_token_id",
        "aux_hidden_state_layer_ids",
        "block_size",
        "markov_rank",
        "markov_head_type",
        "enable_confidence_head",
        "confidence_head_with_markov",
        "sliding_window_non_causal",
    ):
        assert key in raw, key
    assert raw["speculators_config"]["verifier"]["name_or_path"] == str(tiny_target)


def test_vllm_reads_dflash_export_as_non_causal(tiny_target, tmp_path):
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    save_drafter(make_drafter(tiny_target, mode="dflash", block_size=8), tmp_path / "d")
    hf = SpeculatorsConfig.from_pretrained(str(tmp_path / "d"))
    assert hf.dflash_config["sample_from_anchor"] is False
    assert hf.dflash_config["causal"] is False  # full-attention draft layers see their whole block


def test_latent_attention_targets_outside_bf16_get_the_reference_cpu_backend(tmp_path):
    # vLLM's AMX backend for multi-head latent attention takes bf16 weights only, and vLLM picks
    # it on every AMX CPU; test_families' DeepSeek-V3 case (fp32) is what fails without this.
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from cluster.inference import InferenceSettings, engine_kwargs

    def target(name: str, config: dict) -> str:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        return str(tmp_path / name)

    def backend(path: str, dtype: str, device: str = "cpu") -> str | None:
        settings = InferenceSettings(eager_target(path, dtype=dtype), [1, 2], "run/g0", device=device, extract=False)
        return engine_kwargs(settings).get("attention_backend")

    mla, nested = target("mla", {"kv_lora_rank": 512}), target("nested", {"text_config": {"kv_lora_rank": 512}})
    plain = target("plain", {"num_key_value_heads": 4})
    assert backend(mla, dtype="float32") == backend(nested, dtype="float32") == "CPU_MLA"
    assert AttentionBackendEnum["CPU_MLA"]  # a name this vLLM knows
    assert backend(mla, dtype="bfloat16") is None  # the AMX backend's own dtype: vLLM chooses
    assert backend(mla, dtype="float32", device="cuda") is None
    assert backend(plain, dtype="float32") is None
