"""What a config may hold beyond its types: ranges, choices, names, and its fit to the target.

`validate` runs on every loaded config (`cluster.config_load.load_config`); `check_against_target` once the
target's own config is read. Errors name the key, as `ConfigError`.
"""

from __future__ import annotations

import math
import os
import re

from cluster.config import JobConfig
from cluster.config_fields import AT_LEAST_1, CHOICES, RANGE, declared_values
from cluster.errors import ConfigError

PRELOADABLE = ("tcmalloc", "iomp")  # inference.preload, trainer.preload (cluster/hardware.py)
MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")  # `org/name` as hubs spell it
RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")  # one path component: it names folders and actors


def check_box_plan(cfg: JobConfig) -> None:
    """`box_plan`: choices that can be made (where the plan applies: `cluster.box.box_unfit`)."""
    box = cfg.box_plan
    if not box.enabled:
        return
    for key in ("prompts_per_category", "answer_tokens"):
        values = getattr(box, key)
        if not values or not all(AT_LEAST_1.holds(v) for v in values):
            raise ConfigError(f"config error at `box_plan.{key}`: {values!r} must be a non-empty list of numbers >= 1")
    if max(box.answer_tokens) >= cfg.target.max_model_len:
        raise ConfigError(
            f"config error at `box_plan.answer_tokens`: {max(box.answer_tokens)} leaves no room for a "
            f"prompt in target.max_model_len={cfg.target.max_model_len}"
        )


TESTING_ENV = "DSPARK_TESTING"  # "1": the project's test suite, where `testing:` hooks are allowed


def check_testing(cfg: JobConfig, environ=os.environ) -> None:
    """`testing:` hooks (faults, a slower trainer) only where asked for: `testing.enabled` or
    DSPARK_TESTING=1 (the test suite). A user's run never injects faults by a stray key."""
    hooks = cfg.testing.hooks_set()
    if hooks and not (cfg.testing.enabled or environ.get(TESTING_ENV) == "1"):
        raise ConfigError(
            f"config error at `testing.{hooks[0]}`: a test hook (it injects faults or slows the trainer); "
            f"set testing.enabled=true to use it outside the project's tests"
        )


def validate(cfg: JobConfig) -> None:
    """Everything that can be checked without the target: choices, ranges, names, topology."""
    for key, allowed, value in declared_values(cfg, CHOICES):
        if value not in allowed:
            raise ConfigError(f"config error at `{key}`: {value!r} is not one of {allowed}")
    for key, allowed_range, value in declared_values(cfg, RANGE):
        # NaN compares false with any bound, and `.inf` passes a bound on one side only
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"config error at `{key}`: {value!r} is not a finite number (must be {allowed_range})")
        if value is not None and not allowed_range.holds(value):
            why = f": {allowed_range.why}" if allowed_range.why else ""
            raise ConfigError(f"config error at `{key}`: {value!r} is out of range (must be {allowed_range}{why})")
    for category, cap in cfg.data.category_caps.items():
        if not AT_LEAST_1.holds(cap):
            raise ConfigError(
                f"config error at `data.category_caps.{category}`: {cap!r} is out of range (must be {AT_LEAST_1})"
            )
    check_box_plan(cfg)
    check_testing(cfg)
    if not RUN_NAME.match(cfg.run_name) or ".." in cfg.run_name:
        raise ConfigError(
            f"config error at `run_name`: {cfg.run_name!r} must be one folder name "
            "(letters, digits, '.', '_', '-'; no '..', no '/')"
        )
    for name in cfg.data.eval_sets:  # each names its result file (eval-<name>.json) and its entry in result.json
        if not RUN_NAME.match(name) or ".." in name:
            raise ConfigError(
                f"config error at `data.eval_sets`: {name!r} must be a name (letters, digits, '.', '_', "
                "'-'; no '..', no '/'): it names the set's results, eval-<name>.json"
            )
    if cfg.target.name is not None and (not MODEL_ID.match(cfg.target.name) or ".." in cfg.target.name):
        raise ConfigError(f"config error at `target.name`: {cfg.target.name!r} is not a model id like `org/name`")
    if cfg.sampling.max_tokens >= cfg.target.max_model_len:
        raise ConfigError(
            f"config error at `sampling.max_tokens`: {cfg.sampling.max_tokens} leaves no room for a prompt "
            f"within target.max_model_len={cfg.target.max_model_len}"
        )
    t = cfg.transport
    if not 0 < t.low_watermark < t.high_watermark <= 1:
        raise ConfigError("config error at `transport.low_watermark`/`high_watermark`: need 0 < low < high <= 1")
    if not cfg.topology.groups:
        raise ConfigError("config error at `topology.groups`: at least one group is needed")
    names = [g.name for g in cfg.topology.groups]
    if len(set(names)) != len(names):
        raise ConfigError(f"config error at `topology.groups`: group names must be unique, got {names}")
    for i, g in enumerate(cfg.topology.groups):
        where = f"topology.groups[{i}]"
        if not g.min_replicas <= g.inference_replicas <= g.max_replicas:
            raise ConfigError(f"config error at `{where}`: need min_replicas <= inference_replicas <= max_replicas")
        if g.trainer_nodes < 1 or g.trainer_ranks_per_node < 1:
            raise ConfigError(f"config error at `{where}`: a group needs at least one trainer rank")
        lo, hi = g.trainer_rank_bounds()
        if not 1 <= lo <= g.trainer_ranks <= hi:
            raise ConfigError(
                f"config error at `{where}.min_trainer_ranks`/`max_trainer_ranks`: need 1 <= min <= "
                f"trainer_nodes x trainer_ranks_per_node ({g.trainer_ranks}) <= max, got {lo}..{hi}"
            )
        if cfg.device == "cuda" and g.gpus_per_node <= 0:
            raise ConfigError(f"config error at `{where}.gpus_per_node`: device=cuda needs GPUs per node")
        tp, spread = cfg.target.tensor_parallel_size, cfg.target.nodes_per_replica
        if g.gpus_per_node <= 0 and tp % spread:
            raise ConfigError(
                f"config error at `target.nodes_per_replica`: {tp} tensor-parallel ranks do not split "
                f"evenly over {spread} nodes"
            )
        if g.gpus_per_node > 0:
            if tp % spread or not 1 <= tp // spread <= g.gpus_per_node:
                raise ConfigError(
                    f"config error at `target.tensor_parallel_size`: {tp} GPUs over nodes_per_replica={spread} node(s) "
                    f"must be a whole number of GPUs per node, at most gpus_per_node ({g.gpus_per_node}) of `{where}`"
                )
            if g.trainer_ranks_per_node > g.gpus_per_node:
                raise ConfigError(
                    f"config error at `{where}.trainer_ranks_per_node`: {g.trainer_ranks_per_node} ranks "
                    f"(one GPU each) on nodes of {g.gpus_per_node} GPUs"
                )
    for where, names in (("inference.preload", cfg.inference.preload), ("trainer.preload", cfg.trainer.preload)):
        unknown = sorted(set(names) - set(PRELOADABLE))
        if unknown:
            raise ConfigError(f"config error at `{where}`: {unknown} not among {list(PRELOADABLE)}")
    if cfg.inference.backend == "replay" and not cfg.inference.replay_dir:
        raise ConfigError("config error at `inference.replay_dir`: the replay backend needs a folder of samples")


def check_against_target(cfg: JobConfig, target) -> None:
    """What needs the target's (text) config: aux layer ids within its layers, a draft vocabulary
    and mask token within its vocabulary, a context the model supports. Run before any actor
    starts (the job's preparation, `--plan`)."""
    layers, vocab = target.num_hidden_layers, target.vocab_size
    bad = [i for i in cfg.target.aux_layer_ids or [] if not 1 <= i <= layers]
    if bad or len(set(cfg.target.aux_layer_ids or [])) != len(cfg.target.aux_layer_ids or []):
        raise ConfigError(
            f"config error at `target.aux_layer_ids`: {cfg.target.aux_layer_ids} must be distinct ids in "
            f"[1, {layers}] (speculators indexing; the target has {layers} layers)"
        )
    if cfg.drafter.draft_vocab_size is not None and cfg.drafter.draft_vocab_size > vocab:
        raise ConfigError(
            f"config error at `drafter.draft_vocab_size`: {cfg.drafter.draft_vocab_size} is larger than the "
            f"target's vocabulary ({vocab})"
        )
    if cfg.drafter.mask_token_id is not None and cfg.drafter.mask_token_id >= vocab:
        raise ConfigError(
            f"config error at `drafter.mask_token_id`: {cfg.drafter.mask_token_id} is not a token of the "
            f"target's vocabulary ({vocab})"
        )
    tp = cfg.target.tensor_parallel_size
    heads = getattr(target, "num_attention_heads", None)
    kv_heads = getattr(target, "num_key_value_heads", None) or heads
    if heads and heads % tp:
        raise ConfigError(
            f"config error at `target.tensor_parallel_size`: {tp} ranks cannot split the target's "
            f"{heads} attention heads (vLLM shards heads evenly: choose a divisor of {heads})"
        )
    if kv_heads and not getattr(target, "kv_lora_rank", None) and kv_heads % tp and tp % kv_heads:
        # vLLM splits KV heads evenly over the ranks, or replicates them when there are fewer
        # KV heads than ranks (then the ranks must be a multiple of them); latent attention
        # (kv_lora_rank) has no KV heads to split
        raise ConfigError(
            f"config error at `target.tensor_parallel_size`: {tp} ranks cannot split the target's "
            f"{kv_heads} key/value heads (vLLM needs one to divide the other)"
        )
    longest = getattr(target, "max_position_embeddings", None)
    if longest and cfg.target.max_model_len > longest:
        raise ConfigError(
            f"config error at `target.max_model_len`: {cfg.target.max_model_len} is beyond the target's "
            f"max_position_embeddings ({longest})"
        )
