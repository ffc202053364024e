"""What a config field may hold, declared with the field (`ranged`, `choice`): a renamed field
keeps its check. `cluster.config_checks.validate` reads them back from the dataclasses."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, is_dataclass

RANGE, CHOICES = "range", "choices"  # the fields' metadata keys


@dataclass(frozen=True)
class Range:
    lo: float | None = None
    hi: float | None = None
    open_lo: bool = False  # lo itself not allowed
    open_hi: bool = False
    why: str = ""  # said with a value out of range, where the bound is not obvious

    def holds(self, x) -> bool:
        return (self.lo is None or (x > self.lo if self.open_lo else x >= self.lo)) and (
            self.hi is None or (x < self.hi if self.open_hi else x <= self.hi)
        )

    def __str__(self) -> str:
        lo = "" if self.lo is None else f"{'>' if self.open_lo else '>='} {number(self.lo)}"
        hi = "" if self.hi is None else f"{'<' if self.open_hi else '<='} {number(self.hi)}"
        return " and ".join(x for x in (lo, hi) if x)


def number(x: float) -> str:
    """2592000, not 2.592e+06: a bound the user compares with what they wrote."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


POSITIVE, AT_LEAST_1, NON_NEGATIVE, FRACTION = Range(0, open_lo=True), Range(1), Range(0), Range(0, 1)
DAY = 86400
# Every wait, timeout, delay and interval is at most a day: more is a typo or `.inf`, never a
# plan, and a wait that long would hide the hang it is there to catch.
TIMEOUT, DELAY = Range(0, DAY, open_lo=True), Range(0, DAY)
BUDGET = Range(0, 30 * DAY, open_lo=True)  # a job's whole time budget: a month
# Epochs over the same prompts: past 100 the drafter learns the prompts by heart, and the ledger
# holds prompts x epochs entries.
EPOCHS = Range(1, 100, why="more epochs over the same prompts teach them by heart")


def ranged(default, allowed: Range):
    """A numeric field and its range (None, where the field allows it, means "not set")."""
    return field(default=default, metadata={RANGE: allowed})


def choice(default, allowed: tuple):
    """A field whose value is one of `allowed`."""
    return field(default=default, metadata={CHOICES: allowed})


def declared_values(obj, kind: str, prefix: str = "") -> list[tuple[str, object, object]]:
    """(dotted key, what it allows, value) for every field of the config `obj` that declares
    `kind`, its sections' and those of every section in a list (`topology.groups.1.min_replicas`,
    as an override names it), in declaration order."""
    out = []
    for f in fields(obj):
        key, value = f"{prefix}{f.name}", getattr(obj, f.name)
        if kind in f.metadata:
            out.append((key, f.metadata[kind], value))
        if is_dataclass(value):
            out.extend(declared_values(value, kind, f"{key}."))
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                if is_dataclass(item):
                    out.extend(declared_values(item, kind, f"{key}.{i}."))
    return out


def declared(cls, kind: str, prefix: str = "") -> list[tuple[str, object]]:
    """(dotted key, what it allows) for every field of `cls` and of its dataclass sections that
    declares `kind` (RANGE or CHOICES), in declaration order."""
    out = []
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        if kind in f.metadata:
            out.append((key, f.metadata[kind]))
        section = f.default_factory() if f.default_factory is not MISSING else None
        if is_dataclass(section):
            out.extend(declared(type(section), kind, f"{key}."))
    return out
