"""How a config is read: the YAML file and `key=value` overrides on top of the typed defaults
(`cluster.config`), checked (`cluster.config_checks.validate`) and resolved for this machine
(`resolve_for_machine`). Errors name the file or the key, as `ConfigError`.

    cfg = load_config("configs/local.yaml", ["trainer.max_steps=100", "drafter.num_layers=2"])

Its own module on the ground floor: it needs both the schema and its checks, and the checks
need the schema, so the schema imports neither.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from cluster.config import JobConfig, resolve_for_machine
from cluster.config_checks import validate
from cluster.errors import ConfigError


def read_yaml(path: str | Path):
    """The config file as a mapping of sections; ConfigError naming the file (and the line) if
    it is missing, not YAML, or not a mapping at the top."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        data = yaml.safe_load(text)
    except OSError as e:
        raise ConfigError(f"config file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path}: not UTF-8 (byte {e.start})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"config file {path}:{where}: not valid YAML ({getattr(e, 'problem', None) or e})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path}: the top level must be a mapping of sections (run_name:, target:, ...), "
            f"not a {type(data).__name__}"
        )
    return OmegaConf.create(data)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """YAML + `key=value` overrides on top of the typed defaults; errors name the key."""
    key = None
    try:
        merged = OmegaConf.structured(JobConfig)
        if path is not None:
            merged = OmegaConf.merge(merged, read_yaml(path))
        for item in overrides or []:
            key, sep, raw = item.partition("=")
            if not sep:
                raise ConfigError(f"override {item!r} is not key=value")
            # `update` (not a dotlist merge) so list entries can be addressed: topology.groups.0.name=a;
            # a mapping replaces the one there (`data.eval_sets={}` leaves none)
            value = yaml.safe_load(raw) if raw else raw
            OmegaConf.update(merged, key, value, merge=not isinstance(value, dict))
        key = None
        cfg: JobConfig = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        where = getattr(e, "full_key", None) or key
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"config error at `{where}`: {first}") from None
    validate(cfg)
    return resolve_for_machine(cfg)


def explicit_keys(path: str | Path | None, overrides: list[str] | None, embedded: str | Path) -> frozenset[str]:
    """The dotted keys (`data.max_prompts_per_category`) the user set: every `key=value` override
    (a mapping's value, each of its leaves) and every leaf of a config file other than
    `embedded`, the project's own default (`configs/local.yaml`), whose values are the baseline
    the box plan may change. What a user wrote stands (`cluster.box.apply`)."""
    keys: set[str] = set()
    if path is not None and Path(path).resolve() != Path(embedded).resolve():
        keys |= _leaves(OmegaConf.to_container(read_yaml(path)), "")
    for item in overrides or []:
        key, _, raw = item.partition("=")
        value = yaml.safe_load(raw) if raw else raw
        keys |= _leaves(value, key) if isinstance(value, dict) and value else {key}
    return frozenset(keys)


def _leaves(value, prefix: str) -> set[str]:
    if not isinstance(value, dict) or not value:
        return {prefix}
    return set().union(*(_leaves(v, f"{prefix}.{k}" if prefix else str(k)) for k, v in value.items()))
