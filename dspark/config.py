"""`DSparkConfig`: the drafter's architecture and conventions, and its speculators-format JSON.

One class covers both the DSpark drafter and the DFlash ablation (`mode="dflash"`: no Markov
head, no confidence head, the anchor is an input only). The speculators `config.json` is the
contract with vLLM and `speculators`, so every convention key is written explicitly: vLLM's
reader defaults `sample_from_anchor` to False when it is absent, which silently shifts every
draft position of a DSpark drafter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import PretrainedConfig

MODES = ("dspark", "dflash")
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
# Families whose final norm applies `x * (1 + w)` (speculators and vLLM agree on this list).
UNIT_OFFSET_NORM_MODEL_TYPES = frozenset(
    {"gemma", "gemma2", "gemma3", "gemma3_text", "qwen3_5", "qwen3_5_text", "recurrent_gemma"}
)
FORMAT_VERSION = "dspark-cluster/1"


def default_aux_layer_ids(num_target_layers: int, count: int = 5) -> list[int]:
    """`count` evenly spaced layer ids in speculators' indexing (id i = output of layer i-1).

    The range [2, L-2] skips the embedding-like first layers and the last ones, whose states
    are close to the final output already given to the drafter through its anchor token.
    """
    lo, hi = min(2, num_target_layers), max(min(2, num_target_layers), num_target_layers - 2)
    count = min(count, hi - lo + 1)  # shallow targets get fewer layers
    if count <= 1:
        return [(lo + hi) // 2]
    return sorted({round(lo + i * (hi - lo) / (count - 1)) for i in range(count)})


def resolve_mask_token_id(tokenizer) -> int:
    """The token whose embedding fills the masked block slots.

    Our documented choice for targets without a mask token (SmolLM2, Llama, Qwen3): the
    highest-id *added special* token that is not bos/eos/pad/unk and does not occur in the chat
    template, e.g. SmolLM2's `<empty_output>` (16). It never occurs in chat data, so its frozen
    embedding is a clean placeholder. The id is written to `config.json` as `mask_token_id`,
    which vLLM and speculators both read back.
    """
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    reserved = {
        getattr(tokenizer, name, None) for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
    }
    template = getattr(tokenizer, "chat_template", None) or ""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    candidates = [
        int(i)
        for i, tok in decoder.items()
        if getattr(tok, "special", False) and int(i) not in reserved and str(tok) not in template
    ]
    if candidates:
        return max(candidates)
    if getattr(tokenizer, "unk_token_id", None) is not None:
        return int(tokenizer.unk_token_id)
    raise ValueError("tokenizer has no mask, spare special or unk token; set drafter.mask_token_id")


def drafter_attention_shape(tcfg) -> tuple[int, int, int]:
    """(heads, KV heads, head dim) of the drafter's Qwen3-style attention for a target config.

    The target's own shape where it has standard attention. Multi-head latent attention
    (DeepSeek-V3, Kimi K2/K3: the config has `kv_lora_rank`) has no such shape: its query/key
    heads are `qk_nope_head_dim + qk_rope_head_dim` wide and transformers reports `head_dim` as
    the rope part alone (64), which is not a width any drafter layer should have. The drafter
    takes the per-head width of the values and outputs, `v_head_dim` (128 for those targets), with
    one KV head per query head, as the peers' drafters for Kimi targets do.
    """
    heads = tcfg.num_attention_heads
    if getattr(tcfg, "kv_lora_rank", None):
        return heads, heads, int(getattr(tcfg, "v_head_dim", None) or tcfg.hidden_size // heads)
    kv_heads = getattr(tcfg, "num_key_value_heads", None) or heads
    return heads, kv_heads, int(getattr(tcfg, "head_dim", None) or tcfg.hidden_size // heads)


class DSparkConfig(PretrainedConfig):
    """Architecture of a DSpark (or DFlash) drafter for one target model.

    Attention geometry and vocabulary come from the target; `num_layers`, `block_size` and the
    heads are drafter settings. `target_*` fields describe the frozen parts loaded from the
    target checkpoint and the verifier named in the exported config.
    """

    model_type = "dspark_drafter"

    def __init__(
        self,
        mode: str = "dspark",
        num_layers: int = 1,
        block_size: int = 8,
        aux_layer_ids: list[int] | None = None,
        markov_rank: int = 256,
        markov_head_type: str = "vanilla",
        enable_confidence_head: bool | None = None,
        confidence_head_with_markov: bool = True,
        draft_vocab_size: int | None = None,
        mask_token_id: int | None = None,
        sample_from_anchor: bool | None = None,
        hidden_size: int = 576,
        intermediate_size: int = 1536,
        num_attention_heads: int = 9,
        num_key_value_heads: int = 3,
        head_dim: int | None = None,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 10000.0,
        max_position_embeddings: int = 8192,
        target_vocab_size: int = 49152,
        target_num_layers: int = 30,
        target_norm_unit_offset: bool = False,
        target_logit_softcap: float | None = None,
        target_trust_remote_code: bool = False,
        chat_format: dict[str, Any] | None = None,
        layer_types: list[str] | None = None,
        sliding_window: int | None = None,
        sliding_window_non_causal: bool = True,
        verifier_name_or_path: str | None = None,
        verifier_architectures: list[str] | None = None,
        confidence_temperatures: list[float] | None = None,
        **kwargs: Any,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"drafter mode must be one of {MODES}, got {mode!r}")
        if markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"markov_head_type must be one of {MARKOV_HEAD_TYPES}, got {markov_head_type!r}")
        if mode == "dflash":
            markov_rank = 0
            enable_confidence_head = False if enable_confidence_head is None else enable_confidence_head
            sample_from_anchor = False if sample_from_anchor is None else sample_from_anchor
        if enable_confidence_head is None:
            enable_confidence_head = True
        if sample_from_anchor is None:
            sample_from_anchor = True
        if enable_confidence_head and confidence_head_with_markov and markov_rank <= 0:
            confidence_head_with_markov = False
        if block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {block_size}")
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self.mode = mode
        self.num_layers = num_layers
        self.block_size = block_size
        self.aux_layer_ids = list(aux_layer_ids) if aux_layer_ids else default_aux_layer_ids(target_num_layers)
        bad = [i for i in self.aux_layer_ids if not 1 <= i <= target_num_layers]
        if bad or len(set(self.aux_layer_ids)) != len(self.aux_layer_ids):
            raise ValueError(
                f"aux_layer_ids must be distinct ids in [1, {target_num_layers}] "
                f"(speculators indexing), got {self.aux_layer_ids}"
            )
        self.markov_rank = markov_rank
        self.markov_head_type = markov_head_type
        self.enable_confidence_head = enable_confidence_head
        self.confidence_head_with_markov = confidence_head_with_markov
        self.target_vocab_size = target_vocab_size
        self.draft_vocab_size = draft_vocab_size or target_vocab_size
        if not 1 <= self.draft_vocab_size <= target_vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {target_vocab_size}], got {self.draft_vocab_size}")
        self.mask_token_id = mask_token_id
        self.sample_from_anchor = sample_from_anchor
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.target_num_layers = target_num_layers
        self.target_norm_unit_offset = target_norm_unit_offset
        # Gemma 2 style targets cap their logits (cap·tanh(z/cap)); the trainer's target
        # distribution must be the served one.
        self.target_logit_softcap = target_logit_softcap
        self.target_trust_remote_code = target_trust_remote_code
        # `dspark.chat.ChatFormat.record()` of the template the answers were rendered with.
        self.chat_format = dict(chat_format) if chat_format else None
        if layer_types is not None and len(layer_types) != num_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
        if layer_types and any(t not in ("full_attention", "sliding_attention") for t in layer_types):
            raise ValueError(f"layer_types entries must be full_attention|sliding_attention, got {layer_types}")
        if layer_types and "sliding_attention" in layer_types and not sliding_window:
            raise ValueError("sliding_attention layers need sliding_window")
        self.layer_types = list(layer_types) if layer_types else None
        self.sliding_window = sliding_window
        self.sliding_window_non_causal = sliding_window_non_causal
        self.verifier_name_or_path = verifier_name_or_path
        self.verifier_architectures = list(verifier_architectures or [])
        self.confidence_temperatures = list(confidence_temperatures) if confidence_temperatures else None
        super().__init__(**kwargs)

    # ---- derived facts -------------------------------------------------------------------
    @property
    def uses_markov_head(self) -> bool:
        return self.markov_rank > 0

    @property
    def slot_shift(self) -> int:
        """Slot k of a block at anchor p predicts token p + k + slot_shift."""
        return 1 if self.sample_from_anchor else 0

    @property
    def num_speculative_tokens(self) -> int:
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    @property
    def extract_layer_ids(self) -> list[int]:
        """Layers the target must export per token: the aux layers, then the final pre-norm."""
        return [*self.aux_layer_ids, self.target_num_layers]

    def is_sliding(self, layer_idx: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer_idx] == "sliding_attention"

    # ---- construction from a target ------------------------------------------------------
    @classmethod
    def from_target(
        cls, target: str | Path | PretrainedConfig, trust_remote_code: bool = False, **settings: Any
    ) -> DSparkConfig:
        """Drafter config for a target checkpoint dir (or its config) plus drafter settings.

        `trust_remote_code` is for targets whose config class ships in their directory; it is
        recorded, so that everything that reads the target later does the same.
        """
        if isinstance(target, PretrainedConfig):
            tcfg, path = target, getattr(target, "_name_or_path", None)
        else:
            from transformers import AutoConfig

            path = str(target)
            tcfg = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        tcfg = getattr(tcfg, "text_config", None) or tcfg
        rope = getattr(tcfg, "rope_parameters", None) or {}
        rope_theta = rope.get("rope_theta", getattr(tcfg, "rope_theta", 10000.0))
        if "mask_token_id" not in settings and path and Path(path).is_dir():
            from transformers import AutoTokenizer

            settings["mask_token_id"] = resolve_mask_token_id(
                AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
            )
        num_layers = settings.pop("num_layers", 1)
        aux_count = settings.pop("num_aux_layers", 5)
        if not settings.get("aux_layer_ids"):
            settings["aux_layer_ids"] = default_aux_layer_ids(tcfg.num_hidden_layers, aux_count)
        heads, kv_heads, head_dim = drafter_attention_shape(tcfg)
        return cls(
            num_layers=num_layers,
            hidden_size=tcfg.hidden_size,
            intermediate_size=settings.pop("intermediate_size", None)
            or getattr(tcfg, "intermediate_size", None)
            or 3 * tcfg.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=getattr(tcfg, "rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=getattr(tcfg, "max_position_embeddings", 8192),
            target_vocab_size=tcfg.vocab_size,
            target_num_layers=tcfg.num_hidden_layers,
            target_norm_unit_offset=tcfg.model_type in UNIT_OFFSET_NORM_MODEL_TYPES,
            target_logit_softcap=getattr(tcfg, "final_logit_softcapping", None),
            target_trust_remote_code=trust_remote_code,
            verifier_name_or_path=path,
            verifier_architectures=list(getattr(tcfg, "architectures", None) or []),
            **settings,
        )

    # ---- speculators format --------------------------------------------------------------
    def transformer_layer_config(self) -> dict[str, Any]:
        """The Qwen3-style layer config vLLM's qwen3_dflash/qwen3_dspark and speculators build."""
        cfg: dict[str, Any] = {
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "rms_norm_eps": self.rms_norm_eps,
            "vocab_size": self.target_vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": False,
        }
        if self.layer_types:
            cfg.update(layer_types=self.layer_types, sliding_window=self.sliding_window, use_sliding_window=True)
        return cfg

    def to_speculators_dict(self) -> dict[str, Any]:
        if not self.verifier_name_or_path:
            raise ValueError("verifier_name_or_path must be set before export (vLLM requires it)")
        out: dict[str, Any] = {
            "speculators_model_type": self.mode,
            "architectures": ["DSparkSpeculator" if self.mode == "dspark" else "DFlashSpeculator"],
            "transformer_layer_config": self.transformer_layer_config(),
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.hidden_size,
            "block_size": self.block_size,
            "aux_hidden_state_layer_ids": list(self.aux_layer_ids),
            "mask_token_id": self.mask_token_id,
            "sample_from_anchor": self.sample_from_anchor,
            # Always explicit: vLLM's dflash reader turns an absent key into causal=False but
            # an explicit False into causal layers everywhere.
            "sliding_window_non_causal": self.sliding_window_non_causal,
            "speculators_config": {
                "algorithm": self.mode,
                "proposal_methods": [
                    {
                        "proposal_type": "greedy",
                        "speculative_tokens": self.num_speculative_tokens,
                        "verifier_accept_k": 1,
                        "accept_tolerance": 0.0,
                    }
                ],
                "default_proposal_method": "greedy",
                "verifier": {
                    "name_or_path": self.verifier_name_or_path,
                    "architectures": self.verifier_architectures,
                },
            },
            "dspark_cluster": {
                "format": FORMAT_VERSION,
                "target_num_layers": self.target_num_layers,
                "target_norm_unit_offset": self.target_norm_unit_offset,
                "target_logit_softcap": self.target_logit_softcap,
                "target_trust_remote_code": self.target_trust_remote_code,
                "chat_format": self.chat_format,
            },
        }
        if self.mode == "dspark":
            out.update(
                markov_rank=self.markov_rank,
                markov_head_type=self.markov_head_type,
                enable_confidence_head=self.enable_confidence_head,
                confidence_head_with_markov=self.confidence_head_with_markov,
            )
        if self.confidence_temperatures is not None:
            out["confidence_temperatures"] = list(self.confidence_temperatures)
        return out

    @classmethod
    def from_speculators_dict(cls, d: dict[str, Any]) -> DSparkConfig:
        mode = d.get("speculators_model_type")
        if mode not in MODES:
            raise ValueError(f"not a DSpark/DFlash speculators config (speculators_model_type={mode!r})")
        tl = d["transformer_layer_config"]
        ours = d.get("dspark_cluster", {})
        rope = tl.get("rope_parameters") or {}
        verifier = d["speculators_config"]["verifier"]
        return cls(
            mode=mode,
            num_layers=tl["num_hidden_layers"],
            block_size=d["block_size"],
            aux_layer_ids=d["aux_hidden_state_layer_ids"],
            markov_rank=d.get("markov_rank", 0) if mode == "dspark" else 0,
            markov_head_type=d.get("markov_head_type", "vanilla"),
            enable_confidence_head=d.get("enable_confidence_head", False),
            confidence_head_with_markov=d.get("confidence_head_with_markov", False),
            draft_vocab_size=d.get("draft_vocab_size"),
            mask_token_id=d.get("mask_token_id"),
            sample_from_anchor=d.get("sample_from_anchor", False),
            hidden_size=tl["hidden_size"],
            intermediate_size=tl["intermediate_size"],
            num_attention_heads=tl["num_attention_heads"],
            num_key_value_heads=tl.get("num_key_value_heads", tl["num_attention_heads"]),
            head_dim=tl.get("head_dim"),
            rms_norm_eps=tl.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", tl.get("rope_theta", 10000.0))),
            max_position_embeddings=tl.get("max_position_embeddings", 8192),
            target_vocab_size=tl["vocab_size"],
            target_num_layers=ours.get("target_num_layers", max(d["aux_hidden_state_layer_ids"])),
            target_norm_unit_offset=ours.get("target_norm_unit_offset", False),
            target_logit_softcap=ours.get("target_logit_softcap"),
            target_trust_remote_code=ours.get("target_trust_remote_code", False),
            chat_format=ours.get("chat_format"),
            layer_types=tl.get("layer_types"),
            sliding_window=tl.get("sliding_window"),
            sliding_window_non_causal=d.get("sliding_window_non_causal", False),
            verifier_name_or_path=verifier.get("name_or_path"),
            verifier_architectures=verifier.get("architectures"),
            confidence_temperatures=d.get("confidence_temperatures"),
        )
