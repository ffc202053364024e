"""Family conventions the drafter takes from its target's config, checked against transformers:
the attention shape (multi-head latent attention has none of its own), logit soft-capping and
the (1 + w) norm (Gemma 2), the verifier's logits recomputed from the last pre-norm state."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dspark.config import DSparkConfig, drafter_attention_shape
from dspark.model import DSparkDrafter
from dspark.targets import hidden_states_for
from tests.families import copy_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def test_attention_shape_per_family():
    from transformers import DeepseekV3Config, LlamaConfig, PretrainedConfig

    # DeepSeek-V3 / Kimi K2: transformers reports head_dim = qk_rope_head_dim (64); the drafter
    # takes the value head width, one KV head per query head.
    ds = DeepseekV3Config(
        hidden_size=7168,
        num_attention_heads=128,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
    )
    assert ds.head_dim == 64 and drafter_attention_shape(ds) == (128, 128, 128)
    llama = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8)
    assert drafter_attention_shape(llama) == (32, 8, 128)
    k3 = json.loads((ROOT / "configs" / "targets" / "kimi_k3.json").read_text())["text_config"]
    assert drafter_attention_shape(PretrainedConfig(**k3)) == (56, 56, 128)


def test_softcapped_unit_offset_target_logits_match_transformers(tiny_target, tmp_path):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        query_pre_attn_scalar=32,
        final_logit_softcapping=5.0,
        sliding_window=32,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.norm.weight.normal_(0, 0.5)  # (1 + w): a zero-initialised norm would hide the convention
        model.model.embed_tokens.weight.mul_(20.0)  # logits well past the cap, where tanh bends
    model.save_pretrained(tmp_path)
    copy_tokenizer(tiny_target, tmp_path)
    dcfg = DSparkConfig.from_target(tmp_path, num_layers=1, block_size=4, markov_rank=8)
    assert dcfg.target_logit_softcap == 5.0 and dcfg.target_norm_unit_offset
    assert (
        DSparkConfig.from_speculators_dict(json.loads(json.dumps({**dcfg.to_speculators_dict()}))).target_logit_softcap
        == 5.0
    )
    drafter = DSparkDrafter(dcfg)
    drafter.load_target_weights(tmp_path)
    tokens = torch.randint(10, 5000, (24,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=tokens[None]).logits[0].float()
        got = drafter.verifier_logits(hidden_states_for(model, tokens, [cfg.num_hidden_layers])[:, 0])
    assert float(want.abs().max()) > 4.0  # the cap matters here
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
