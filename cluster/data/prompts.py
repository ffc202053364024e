"""The job's prompts: every source read, de-duplicated by id, split into train / held-out and
capped as the config says; the evaluation sets checked against them."""

from __future__ import annotations

import json
import logging

from cluster.config import ConfigError, JobConfig
from cluster.preflight import judged_sets, read_checked, read_prompt_files, repo_path

log = logging.getLogger("dspark.job")

__all__ = ["calibration_split", "check_eval_sets", "load_prompts", "repo_path"]


def load_prompts(cfg: JobConfig, conversations: list | None = None):
    """All prompt sources (`conversations`: as `cluster.preflight.check_inputs` read them; None:
    read them here), de-duplicated by id, split into train / held-out."""
    from dspark.prompts import cap_per_category, split

    convs = read_prompt_files(cfg) if conversations is None else conversations
    train, held = split(convs, cfg.data.heldout_fraction, cfg.data.split_seed)
    unknown = sorted(set(cfg.data.category_caps) - {c.category for c in train})
    if unknown:  # a misspelt category would cap nothing, silently
        raise ConfigError(
            f"config error at `data.category_caps`: no training prompt of data.prompts has "
            f"category {', '.join(map(repr, unknown))} (they have "
            f"{', '.join(sorted({str(c.category) for c in train}))})"
        )
    if cfg.data.max_prompts_per_category or cfg.data.category_caps:
        train = cap_per_category(train, cfg.data.max_prompts_per_category, cfg.data.split_seed, cfg.data.category_caps)
    if cfg.data.max_prompts:
        train = train[: cfg.data.max_prompts]
    if not train:
        raise ConfigError(
            f"config error at `data.prompts`: no training prompts in {list(cfg.data.prompts)} "
            f"({len(convs)} read, {len(held)} held out): nothing to train on"
        )
    log.info(
        "prompts: %d read from %s, %d to train on, %d held out",
        len(convs),
        list(cfg.data.prompts),
        len(train),
        len(held),
    )
    return train, held


def calibration_split(heldout: list, eval_limit: int | None, n: int) -> tuple[list, list]:
    """(calibration prompts, evaluated prompts) of the held-out split: the evaluation takes
    `eval_limit` round-robin over categories (as `dspark.evaluate` and the served evaluation
    do); the calibration split is the next `n` of the rest, taken the same way. Neither is
    trained on, and the two never share a prompt."""
    from dspark.tau_report import stratified

    evaluated = stratified(heldout, lambda c: c.category, eval_limit)
    taken = {c.id for c in evaluated}
    rest = [c for c in heldout if c.id not in taken]
    return (stratified(rest, lambda c: c.category, n) if n else []), evaluated


def check_eval_sets(cfg: JobConfig, train) -> None:
    """Every `data.eval_sets` file reads, has prompts, and shares none with the training prompts
    (a set trained on would measure memory, not generalisation)."""

    def key(c) -> str:
        return json.dumps(c.prompt_messages, sort_keys=True)

    trained = {key(c): c.id for c in train}
    for where, src in judged_sets(cfg).items():
        path = repo_path(src)
        convs = read_checked(path, where)
        both = next((c for c in convs if key(c) in trained), None)
        if both is not None:
            raise ConfigError(
                f"config error at `{where}`: prompt {both.id} of {path} is also the "
                f"training prompt {trained[key(both)]}"
            )
