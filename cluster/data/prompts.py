"""The job's prompts: every source read, de-duplicated by id, split into train / held-out and
capped as the config says; the evaluation sets checked against them."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from cluster.config import ROOT, JobConfig

log = logging.getLogger("dspark.job")


def repo_path(src: str) -> Path:
    """A path of the config: absolute, or relative to the repository."""
    return Path(src) if Path(src).is_absolute() else ROOT / src


def load_prompts(cfg: JobConfig):
    """All prompt sources, de-duplicated by id, split into train / held-out."""
    from dspark.prompts import cap_per_category, read_conversations, split

    convs, seen = [], set()
    for src in cfg.data.prompts:
        got, report = read_conversations(repo_path(src))
        log.info("%s", report.summary())
        for c in got:
            if c.id in seen:
                raise ValueError(f"prompt id {c.id!r} appears twice across data.prompts")
            seen.add(c.id)
            convs.append(c)
    train, held = split(convs, cfg.data.heldout_fraction, cfg.data.split_seed)
    unknown = sorted(set(cfg.data.category_caps) - {c.category for c in train})
    if unknown:  # a misspelt category would cap nothing, silently
        from cluster.config import ConfigError

        raise ConfigError(f"config error at `data.category_caps`: no training prompt of data.prompts has "
                          f"category {', '.join(map(repr, unknown))} (they have "
                          f"{', '.join(sorted({str(c.category) for c in train}))})")
    if cfg.data.max_prompts_per_category or cfg.data.category_caps:
        train = cap_per_category(train, cfg.data.max_prompts_per_category, cfg.data.split_seed,
                                 cfg.data.category_caps)
    if cfg.data.max_prompts:
        train = train[: cfg.data.max_prompts]
    if not train:
        raise ValueError(f"no training prompts in data.prompts={list(cfg.data.prompts)} "
                         f"({len(convs)} read, {len(held)} held out): nothing to train on")
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
    from cluster.config import ConfigError
    from dspark.prompts import read_conversations

    def key(c) -> str:
        return json.dumps(c.prompt_messages, sort_keys=True)

    trained = {key(c): c.id for c in train}
    for name, src in cfg.data.eval_sets.items():
        path = repo_path(src)
        if not path.exists():
            raise ConfigError(f"config error at `data.eval_sets.{name}`: {path} does not exist")
        convs, _ = read_conversations(path)
        if not convs:
            raise ConfigError(f"config error at `data.eval_sets.{name}`: no prompts in {path}")
        both = next((c for c in convs if key(c) in trained), None)
        if both is not None:
            raise ConfigError(f"config error at `data.eval_sets.{name}`: prompt {both.id} of {path} is also the "
                              f"training prompt {trained[key(both)]}")
