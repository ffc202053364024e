"""docs/configuration.md is generated from the typed config (scripts/config_reference.py): every
field carries a comment in the source, and the committed page is what the script writes."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import fields, is_dataclass

from cluster.config import ROOT, GroupConfig, JobConfig

spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
config_reference = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = config_reference  # its dataclass looks its module up there
spec.loader.exec_module(config_reference)


def _all_fields(cls, seen=None):
    seen = set() if seen is None else seen
    if cls in seen:
        return []
    seen.add(cls)
    out = []
    for f in fields(cls):
        out.append((cls.__name__, f.name))
        default = config_reference._default(f)
        if is_dataclass(default):
            out.extend(_all_fields(type(default), seen))
    return out


def test_every_field_has_a_comment_in_the_source():
    missing = config_reference.undocumented()
    assert not missing, (
        "config fields without a comment (write one above or beside each in the source, then run "
        "python scripts/config_reference.py):\n  " + "\n  ".join(missing)
    )


def test_the_source_parse_sees_every_field():
    src = config_reference.read_source_fields()
    every = _all_fields(JobConfig) + _all_fields(GroupConfig)
    assert len(every) > 100
    assert not [k for k in every if k not in src]


def test_every_leaf_field_has_a_row_on_the_page():
    page = config_reference.render()
    for prefix, cls, _, _ in config_reference.sections():
        for f in fields(cls):
            default = config_reference._default(f)
            if is_dataclass(default) or (isinstance(default, list) and default and is_dataclass(default[0])):
                continue
            assert f"| `{prefix}{f.name}` |" in page, prefix + f.name


def test_the_committed_page_is_what_the_script_writes():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == config_reference.render(), (
        "docs/configuration.md is stale: run python scripts/config_reference.py and commit the page"
    )
