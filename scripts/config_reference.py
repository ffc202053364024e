"""Write docs/configuration.md, the reference of every config field, from the typed config itself.

Each field's default, type and declared range or choices come from the dataclasses
(`cluster/config.py`, `cluster/config_data.py`; `ranged` and `choice`, `cluster/config_fields.py`);
its meaning from the comment lines above it and beside it in the source (read with `tokenize`);
which shipped config sets it, and to what, from `configs/*.yaml`. The page is generated, never
edited by hand: tests/unit/test_config_reference.py fails on a field without a comment and on a
committed page that differs from what this script writes.

    python scripts/config_reference.py            # write docs/configuration.md
    python scripts/config_reference.py --check    # exit 1 if it is stale
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import sys
import tokenize
from dataclasses import MISSING, dataclass, fields, is_dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cluster.config import GroupConfig, JobConfig  # noqa: E402
from cluster.config_fields import CHOICES, RANGE, number  # noqa: E402

SOURCES = ("cluster/config.py", "cluster/config_data.py")
PAGE = ROOT / "docs" / "configuration.md"


@dataclass
class SourceField:
    cls: str
    name: str
    file: str
    line: int
    annotation: str
    comment: str  # "" where the source has none


def read_source_fields(sources=SOURCES, root: Path = ROOT) -> dict[tuple[str, str], SourceField]:
    """(class, field) -> the field as its source declares it: annotation and comment. A field's
    comment is the block of comment lines right above it (no blank line between), those inside
    its statement (a call split over lines) and the one at the end of its lines."""
    out = {}
    for rel in sources:
        src = (root / rel).read_text()
        lines = src.splitlines()
        comments: dict[int, tuple[str, bool]] = {}  # line -> (text, alone on its line)
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):
            if tok.type == tokenize.COMMENT:
                text = tok.string.lstrip("#").strip()
                comments[tok.start[0]] = (text, lines[tok.start[0] - 1].lstrip().startswith("#"))
        for cls in ast.parse(src).body:
            if not isinstance(cls, ast.ClassDef):
                continue
            for st in cls.body:
                if not (isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)):
                    continue
                above, ln = [], st.lineno - 1
                while ln in comments and comments[ln][1]:
                    above.insert(0, comments[ln][0])
                    ln -= 1
                own = range(st.lineno, st.end_lineno + 1)
                inner = [comments[i][0] for i in own if i in comments and comments[i][1]]
                beside = [comments[i][0] for i in own if i in comments and not comments[i][1]]
                text = " ".join(x for x in above + inner + beside if x)
                out[(cls.name, st.target.id)] = SourceField(
                    cls.name, st.target.id, rel, st.lineno, ast.unparse(st.annotation), text
                )
    return out


def shipped_configs(root: Path = ROOT) -> dict[str, dict]:
    return {p.stem: yaml.safe_load(p.read_text()) or {} for p in sorted((root / "configs").glob("*.yaml"))}


def _lookup(tree, path: list[str]):
    """The values a YAML tree holds at `path` ("*" matches every item of a list)."""
    nodes = [tree]
    for part in path:
        nxt = []
        for n in nodes:
            if part == "*" and isinstance(n, list):
                nxt.extend(n)
            elif isinstance(n, dict) and part in n:
                nxt.append(n[part])
        nodes = nxt
    return nodes


def _value(v) -> str:
    if v is None:
        return "None"
    if isinstance(v, str):
        return v if v else '""'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return number(v)
    if isinstance(v, list | dict):
        return json.dumps(v, ensure_ascii=False)
    return str(v)


def _code(text: str) -> str:
    text = text.replace("|", "\\|")
    fence = "``" if "`" in text else "`"
    pad = " " if "`" in text else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _prose(text: str) -> str:
    """A comment as table-cell Markdown: pipes escaped, `<` outside code spans escaped."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # outside code spans
        parts[i] = parts[i].replace("<", "&lt;")
    return "`".join(parts).replace("|", "\\|")


def _default(f) -> object:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def _allowed(f, annotation: str) -> str:
    meta = f.metadata
    if RANGE in meta:
        r = meta[RANGE]
        text = str(r) or "any"
        if "None" in annotation:
            text += ", or None"
        return text + (f" ({r.why})" if r.why else "")
    if CHOICES in meta:
        return "one of " + ", ".join(_code(c) for c in meta[CHOICES])
    return ""


def rows_of(cls, prefix: str, yaml_path: list[str], src, configs) -> list[str]:
    rows = []
    for f in fields(cls):
        sf = src[(cls.__name__, f.name)]
        default = _default(f)
        if is_dataclass(default) or (isinstance(default, list) and default and is_dataclass(default[0])):
            continue  # a section: its own table
        default_text = "required" if default is MISSING or default == "???" else _code(_value(default))
        sets = []
        for name, tree in configs.items():
            values = _lookup(tree, yaml_path + [f.name])
            if values:
                distinct = list(dict.fromkeys(_value(v) for v in values))
                sets.append(f"{name}: " + ", ".join(_code(v) for v in distinct))
        meaning = _prose(sf.comment)
        if sets:
            meaning += " <br>*Set in configs/:* " + "; ".join(sets)
        rows.append(
            f"| {_code(prefix + f.name)} | {_code(sf.annotation)} | {default_text} "
            f"| {_allowed(f, sf.annotation)} | {meaning} |"
        )
    return rows


def sections() -> list[tuple[str, type, list[str], str]]:
    """(key prefix, dataclass, YAML path, title) for every table, in the config's order."""
    out = [("", JobConfig, [], "Top level")]
    for f in fields(JobConfig):
        default = _default(f)
        if is_dataclass(default):
            out.append((f"{f.name}.", type(default), [f.name], f"`{f.name}:`"))
            for g in fields(default):
                items = _default(g)
                if isinstance(items, list) and items and is_dataclass(items[0]):
                    out.append(
                        (f"{f.name}.{g.name}.N.", type(items[0]), [f.name, g.name, "*"], f"`{f.name}.{g.name}:` (each)")
                    )
    return out


HEADER = """<!-- Generated by scripts/config_reference.py from cluster/config.py and cluster/config_data.py:
edit the comments there and run the script; tests/unit/test_config_reference.py fails on a stale page. -->

# Configuration reference

Every key a job's config may set, section by section, with its default, what it may hold, what
it is and when to change it. A config is a YAML file (`configs/`), and any key can be overridden
on the command line as `section.key=value`:

```bash
scripts/run_local.sh trainer.max_steps=50 drafter.num_layers=2
python jobs/train_kimi_k3.py --config configs/kimi_k3.yaml --plan topology.groups.0.inference_replicas=2
```

How to read the tables:

- **Default** is the dataclass's; a shipped config may set another value, listed under *Set in
  configs/* (`local`, `local_2groups`, `single_node_8gpu`, `kimi_k3`).
- **Allowed** is the range or the choices declared with the field (`ranged`, `choice` in
  `cluster/config_fields.py`): a value outside it is refused before anything starts, naming the
  key (``config error at `trainer.lr`: -0.001 is out of range (must be > 0)``). Every wait, timeout,
  delay and interval is at most a day (86400 s: more is a typo or `.inf`, never a plan), a job's
  whole time budget at most 30 days, `data.epochs` at most 100; NaN and infinities are refused
  everywhere. Some checks span keys (`cluster/config_checks.py`): `min_replicas <=
  inference_replicas <= max_replicas`, a TP size the target's heads split into, aux layers and a
  draft vocabulary the target has.
- Unknown keys and wrong types are refused too, naming the key.
- `None` means "not set"; the description says what happens then.
- `topology.groups` is a list: in an override, `topology.groups.0.min_replicas=1`.
"""


def render() -> str:
    src = read_source_fields()
    configs = shipped_configs()
    out = [HEADER]
    for prefix, cls, path, title in sections():
        out.append(f"## {title}\n")
        doc = (cls.__doc__ or "").strip()
        if doc and not doc.startswith(cls.__name__ + "("):  # dataclasses invent one when there is none
            out.append(" ".join(doc.split()) + "\n")
        out.append("| key | type | default | allowed | what it is, when to change it |")
        out.append("|---|---|---|---|---|")
        out.extend(rows_of(cls, prefix, path, src, configs))
        out.append("")
    return "\n".join(out)


def undocumented() -> list[str]:
    """'file:line class.field' of every field of the job's config without a comment."""
    src = read_source_fields()
    seen, out = set(), []
    todo = [JobConfig, GroupConfig]
    while todo:
        cls = todo.pop(0)
        if cls in seen:
            continue
        seen.add(cls)
        for f in fields(cls):
            sf = src.get((cls.__name__, f.name))
            if sf is None or not sf.comment:
                where = f"{sf.file}:{sf.line}" if sf else "?"
                out.append(f"{where} {cls.__name__}.{f.name}")
            default = _default(f)
            if is_dataclass(default):
                todo.append(type(default))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is stale")
    args = ap.parse_args(argv)
    missing = undocumented()
    if missing:
        print("fields without a comment (write one above or beside each):\n  " + "\n  ".join(missing), file=sys.stderr)
        return 1
    page = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != page:
            print(f"{PAGE.relative_to(ROOT)} is stale: run python scripts/config_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    print(f"[config_reference] wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
