"""Tiny random-weight targets, one per model family, built from each family's real transformers
config class (never downloaded). They share SmolLM2's tokenizer and chat template, so a family
test exercises the family's layers, norms and weight names, not a tokenizer.

Sizes are the smallest that still have each family's structure: several layers (so aux layer
ids are spread), grouped-query attention, a few experts with top-2 routing and a shared expert
where the family has one, a dense first layer where the family has one, MLA with q and kv LoRA
ranks for DeepSeek-V3 (512 + 64 wide, the only latent width vLLM's CPU MLA kernel compiles),
head widths vLLM's CPU attention supports (32). Embeddings are scaled up so the random target is
peaked: its greedy answer is the same under vLLM's and transformers' numerics, and a drafter
learns it quickly. (A tied random model answers by repeating one token — the LM head is the
embedding its residual stream carries — so only the families that tie in real life are tied.)

`vllm_extracts`: whether vLLM 0.32's model class for the family implements the aux-hidden-state
interface that hidden-state capture (`cluster.inference.capture_model`) needs;
`cluster.target.vllm_extraction_gap` asks vLLM the same question for a real target.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB = 49152  # SmolLM2's tokenizer
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
MOE = dict(moe_intermediate_size=32, num_experts_per_tok=2)


@dataclass(frozen=True)
class Family:
    name: str
    config_class: str  # in transformers
    settings: dict
    model_class: str = "AutoModelForCausalLM"
    vllm_extracts: bool = True  # vLLM's model implements the aux-hidden-state interface
    why_not: str = ""


FAMILIES = {
    f.name: f
    for f in (
        Family(
            "llama",
            "LlamaConfig",
            dict(intermediate_size=128, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False),
        ),  # Llama 3 8B/70B; SmolLM2 is the tied one
        Family(
            "qwen3",
            "Qwen3Config",
            dict(intermediate_size=128, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
        ),  # Qwen3 0.6B-4B
        Family(
            "qwen3_moe",
            "Qwen3MoeConfig",
            dict(
                intermediate_size=128,
                num_key_value_heads=2,
                head_dim=32,
                num_experts=4,
                norm_topk_prob=True,
                tie_word_embeddings=False,
                **MOE,
            ),
        ),
        Family(
            "gemma3",
            "Gemma3TextConfig",
            dict(
                intermediate_size=128,
                num_key_value_heads=2,
                head_dim=32,
                query_pre_attn_scalar=32,
                sliding_window=64,
                tie_word_embeddings=True,
                layer_types=["sliding_attention"] * 5 + ["full_attention"],
            ),
            vllm_extracts=False,
            why_not="vLLM's Gemma3ForCausalLM has no aux-hidden-state interface",
        ),
        Family(
            "glm4_moe",
            "Glm4MoeConfig",
            dict(
                intermediate_size=128,
                num_key_value_heads=2,
                head_dim=32,
                n_routed_experts=4,
                n_shared_experts=1,
                first_k_dense_replace=1,
                n_group=1,
                topk_group=1,
                use_qk_norm=True,
                partial_rotary_factor=0.5,
                tie_word_embeddings=False,
                **MOE,
            ),
            vllm_extracts=False,
            why_not="vLLM's Glm4MoeForCausalLM has no aux-hidden-state interface",
        ),
        Family(
            "deepseek_v3",
            "DeepseekV3Config",
            dict(
                intermediate_size=128,
                num_key_value_heads=4,
                n_routed_experts=4,
                n_shared_experts=1,
                first_k_dense_replace=1,
                n_group=1,
                topk_group=1,
                kv_lora_rank=512,
                q_lora_rank=64,
                qk_rope_head_dim=64,
                qk_nope_head_dim=32,
                v_head_dim=32,
                topk_method="noaux_tc",
                scoring_func="sigmoid",
                tie_word_embeddings=False,
                **MOE,
            ),
        ),
    )
}


def build_family_target(family: str, out: Path, tokenizer_from: Path, seed: int = 1234) -> Path:
    """Write a tiny random `family` checkpoint with `tokenizer_from`'s tokenizer into `out`."""
    import transformers

    f = FAMILIES[family]
    cfg = getattr(transformers, f.config_class)(**{**COMMON, **f.settings})
    torch.manual_seed(seed)
    model = getattr(transformers, f.model_class).from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(8.0)
        if not cfg.tie_word_embeddings:
            model.get_output_embeddings().weight.mul_(8.0)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    copy_tokenizer(tokenizer_from, out)
    return out


def copy_tokenizer(src: Path, dest: Path) -> None:
    for p in src.iterdir():
        if p.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(p, dest / p.name)


# ---- a target whose architecture ships as code in its own directory ---------------------------

REMOTE_CONFIG_PY = """import os
from pathlib import Path

from transformers import LlamaConfig

# Proof that this file ran: tests check it does not unless trust_remote_code was asked for.
if os.environ.get("DSPARK_REMOTE_CODE_MARKER"):
    Path(os.environ["DSPARK_REMOTE_CODE_MARKER"]).touch()


class TinyRemoteConfig(LlamaConfig):
    model_type = "tiny_remote"
"""

REMOTE_MODELING_PY = """from transformers import LlamaForCausalLM, LlamaModel

from .configuration_tiny_remote import TinyRemoteConfig


class TinyRemoteModel(LlamaModel):
    config_class = TinyRemoteConfig


class TinyRemoteForCausalLM(LlamaForCausalLM):
    config_class = TinyRemoteConfig
"""


def build_remote_code_target(out: Path, tokenizer_from: Path, seed: int = 1234) -> Path:
    """A tiny model of an architecture neither transformers nor vLLM know (`tiny_remote`): its
    config and modeling code live in `out` and are named by `auto_map` in config.json, as
    remote-code checkpoints on a hub do (`AutoModel` too: vLLM's Transformers backend, which runs
    such models, builds the base model through it)."""
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    settings = {**COMMON, **FAMILIES["llama"].settings, "num_hidden_layers": 4}
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings))
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(8.0)
        model.get_output_embeddings().weight.mul_(8.0)
    model.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config.update(
        model_type="tiny_remote",
        architectures=["TinyRemoteForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_tiny_remote.TinyRemoteConfig",
            "AutoModel": "modeling_tiny_remote.TinyRemoteModel",
            "AutoModelForCausalLM": "modeling_tiny_remote.TinyRemoteForCausalLM",
        },
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "configuration_tiny_remote.py").write_text(REMOTE_CONFIG_PY)
    (out / "modeling_tiny_remote.py").write_text(REMOTE_MODELING_PY)
    copy_tokenizer(tokenizer_from, out)
    return out
