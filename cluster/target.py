"""The target as the job reads it on the driver, before any actor starts: where it is, its text
config, the chat format its conversations are rendered with, and whether the configured
inference backend can extract its hidden states. Each problem is a `ConfigError` naming the key
to change and the dependency's own message.

On the ground floor: the capacity plan (`cluster.scaling`), the box's plan (`cluster.box`), the
inference room and the job all read the target, and vLLM's answer for the target's family
(`vllm_class`, `capture_gap`) lives here too, so that the check needs no room; the inference
room's capture model (`cluster.inference.capture_model`) builds on the same two functions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from cluster.config import LOCAL_TARGET, RANDOM_TARGET, ConfigError, JobConfig
from cluster.config_checks import check_against_target
from cluster.preflight import check_target_path
from dspark.chat import ChatFormat

log = logging.getLogger("cluster.target")

PROBE_CONVERSATION = [
    {"role": "user", "content": "Hello."},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "How are you?"},
]


@dataclass(frozen=True)
class TargetFacts:
    path: str
    config: object  # the target's text config (transformers PretrainedConfig)
    chat: ChatFormat
    trust_remote_code: bool


def resolve_target(cfg: JobConfig) -> str:
    if cfg.target.path == LOCAL_TARGET:
        from dspark.targets import prepare_smollm2

        return str(prepare_smollm2())
    if cfg.target.path == RANDOM_TARGET:
        from dspark.targets import prepare_random_llama

        return str(prepare_random_llama())
    check_target_path(cfg)
    return cfg.target.path


def read_config(path: str, trust_remote_code: bool):
    from dspark.targets import load_target_config

    try:
        return load_target_config(path, trust_remote_code)
    except (OSError, ValueError) as e:  # not JSON, no model_type, an unknown architecture: a config mistake
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if not trust_remote_code and "trust_remote_code" in str(e):
            raise ConfigError(
                f"config error at `target.trust_remote_code`: {path} ships its own model code (config.json "
                f"`auto_map`), which runs only with target.trust_remote_code=true; set it if you trust "
                f"that code. transformers: {first}"
            ) from None
        raise ConfigError(
            f"config error at `target.path`: transformers cannot read {path} as a model: {first}"
        ) from None


def read_chat_format(cfg: JobConfig, path: str) -> ChatFormat:
    """The configured template and options, tried once on a small conversation with the target's
    tokenizer, so that a missing file or a template that fails with these options stops the job
    here rather than in every replica."""
    from transformers import AutoTokenizer

    from dspark.chat import render_with_loss_mask

    t = cfg.target
    try:
        chat = ChatFormat.from_options(t.chat_template, t.chat_template_kwargs)
    except OSError as e:
        raise ConfigError(f"config error at `target.chat_template`: cannot read {t.chat_template}: {e}") from None
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=t.trust_remote_code)
    try:
        render_with_loss_mask(tok, PROBE_CONVERSATION, chat)
    except Exception as e:  # jinja's errors, a template without an assistant turn, ...
        key = "target.chat_template" if t.chat_template else "target.chat_template_kwargs"
        raise ConfigError(
            f"config error at `{key}`: the chat template ({t.chat_template or 'the tokenizer’s own'}, "
            f"options {dict(t.chat_template_kwargs)}) fails on a two-turn conversation: "
            f"{type(e).__name__}: {e}"
        ) from None
    return chat


def vllm_class(arch: str) -> type | None:
    """vLLM's model class registered under `arch`, None if it has none."""
    from vllm.model_executor.models.registry import ModelRegistry

    # A private loader (vLLM 0.32): the public resolver needs a whole ModelConfig.
    return ModelRegistry._try_load_model_cls(arch)


def capture_gap(cls: type) -> str | None:
    """Why `cls` cannot capture hidden states, or None when it can."""
    from vllm.model_executor.models.interfaces import supports_eagle3

    return (
        None
        if supports_eagle3(cls)
        else (
            f"vLLM's {cls.__name__} does not implement the aux-hidden-state interface (SupportsEagle3) that "
            f"hidden-state capture needs"
        )
    )


def vllm_extraction_gap(architectures: list[str]) -> str | None:
    """Why vLLM cannot export aux hidden states for this architecture (its model class lacks the
    EAGLE-3 aux-hidden-state interface `cluster.inference.capture_model` needs), or None when it can or
    when vLLM does not know the class here (a remote-code target: the replica will say)."""
    try:
        import vllm.model_executor.models.registry  # noqa: F401 - no vLLM here: nothing to ask
    except ImportError:
        return None
    for arch in architectures:
        cls = vllm_class(arch)
        if cls is not None:
            return capture_gap(cls)
    return None


def read_target(cfg: JobConfig) -> TargetFacts:
    path = resolve_target(cfg)
    tcfg = read_config(path, cfg.target.trust_remote_code)
    check_against_target(cfg, tcfg)
    chat = read_chat_format(cfg, path)
    if cfg.inference.backend == "vllm":
        gap = vllm_extraction_gap(list(getattr(tcfg, "architectures", None) or []))
        if gap:
            raise ConfigError(
                f"config error at `target.path`: {path} ({', '.join(tcfg.architectures)}): {gap}; "
                f"train from transformers-captured states offline (dspark.hf_dataset) instead"
            )
    return TargetFacts(path, tcfg, chat, cfg.target.trust_remote_code)
