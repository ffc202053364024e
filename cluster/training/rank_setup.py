"""What a trainer rank is set up from: its settings, its drafter's config, the DeepSpeed config,
the draft vocabulary, and torch told to load DeepSpeed checkpoints without running code."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from cluster.config import DrafterConfig, TrainerConfig
from cluster.store import StoreConfig
from dspark.chat import TOKENIZER_DEFAULT, ChatFormat


@dataclass
class TrainerSettings:
    """What every rank needs, typed (it crosses the Ray boundary as is)."""

    target_path: str
    drafter: DrafterConfig
    trainer: TrainerConfig
    store: StoreConfig
    device: str = "cpu"
    total_steps: int = 1000
    aux_layer_ids: list[int] | None = None
    extensions_dir: str | None = None
    trust_remote_code: bool = False  # target.trust_remote_code
    chat: ChatFormat = TOKENIZER_DEFAULT  # recorded in the exported drafter


def load_checkpoints_without_code() -> None:
    """DeepSpeed reads its checkpoints with `torch.load(weights_only=False)`, which runs whatever
    a pickled file asks for, and resume reads them from shared storage. In this process torch is
    told to load weights only (`TORCH_FORCE_WEIGHTS_ONLY_LOAD` overrides the call site's False),
    with the three plain DeepSpeed types its checkpoints hold allowed (measured with DeepSpeed
    0.19.8, ZeRO 1 and 2, fp32 and bf16): anything else in a checkpoint file is refused."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    torch.serialization.add_safe_globals([LossScaler, ZeroStageEnum, fragment_address])


def deepspeed_config(t: TrainerConfig, world_size: int, load_universal: bool = False) -> dict:
    """`load_universal`: the checkpoint to load is in DeepSpeed's universal format (a resize)."""
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": t.zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if t.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if load_universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def drafter_config(s: TrainerSettings, model_init: dict):
    """The drafter's config: a checkpointed one (`model_init["config"]`), or one made from the
    target and the config's drafter section."""
    from dspark.config import DSparkConfig

    if "config" in model_init:
        return DSparkConfig.from_speculators_dict(model_init["config"])
    from transformers import AutoTokenizer

    d = s.drafter
    dspark = d.mode == "dspark"
    tok = AutoTokenizer.from_pretrained(s.target_path, trust_remote_code=s.trust_remote_code)
    return DSparkConfig.from_target(
        s.target_path, trust_remote_code=s.trust_remote_code, chat_format=s.chat.record(tok),
        mode=d.mode, num_layers=d.num_layers, block_size=d.block_size,
        markov_rank=d.markov_rank if dspark else 0, markov_head_type=d.markov_head_type,
        enable_confidence_head=d.enable_confidence_head if dspark else False,
        draft_vocab_size=d.draft_vocab_size, aux_layer_ids=s.aux_layer_ids,
        **({"mask_token_id": d.mask_token_id} if d.mask_token_id is not None else {}),
    )


def vocab_mapping_from(samples_tokens: list[tuple[torch.Tensor, torch.Tensor]], vocab_size: int, draft_vocab_size: int,
                       always: list[int]) -> dict:
    from dspark.vocab import build_vocab_mapping, token_frequencies

    d2t, t2d = build_vocab_mapping(token_frequencies(samples_tokens, vocab_size), draft_vocab_size, always)
    return {"d2t": d2t.tolist(), "t2d": t2d.tolist()}
