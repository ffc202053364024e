"""The Grafana dashboard (deploy/grafana/dspark_dashboard.json) against what the code exports:
every panel's query names only series the job really sets, every series the job sets is on
some panel, and counters are read as rates (rate()/increase()), gauges as gauges. The exported set
is recorded, not listed: the progress reporter, the evaluation's gauges and the autoscaler run
against a recording metrics backend, and Ray's naming is applied (`ray_` in front; a counter is
read as `<name>_total`).

`evaluate_panels` runs every panel's query against a real Prometheus that scraped a real job
(tests/integration/test_job.py's end-to-end run): a query that returns nothing for a series the
job set fails there, with the panel's title."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from cluster.config import AutoscalerConfig
from cluster.data import GroupCounts, LedgerCounts
from cluster.job import TrainingStats
from cluster.job.progress import TRAIN_METRICS, ProgressReporter
from cluster.metrics import Metrics
from cluster.scaling.autoscaler import Autoscaler
from cluster.scaling.policy import GroupState
from cluster.training import StepResult
from tests.unit.test_metrics import FakeBackend

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dspark_dashboard.json"
SERIES = re.compile(r"\bray_dspark_[a-z0-9_]+")


class Ledger:
    def counts(self) -> LedgerCounts:
        g = GroupCounts(stored=3, queued_bytes=1000, produced_samples=5, trained_samples=2)
        return LedgerCounts(pending=1, stored=3, trained=2, total=6, groups={"g0": g})


class Pool:
    def stats(self) -> list[dict]:
        return [{"tokens_per_s": 12.0}]

    def __len__(self) -> int:
        return 1


class Services:
    def daemon_restarts(self) -> int:
        return 0

    def master_info(self) -> dict:
        return {"restarts": 0}


def exported() -> set[str]:
    """Every series the job sets, named as Prometheus shows them."""
    return set(exported_kinds())


def exported_kinds() -> dict[str, str]:
    """Every series the job sets, named as Prometheus shows them -> "counter" or "gauge"."""
    metrics = Metrics(tags={"run": "r"}, backend=FakeBackend)
    step = StepResult(
        step=1,
        rank=0,
        skipped=False,
        nonfinite=False,
        tokens=10,
        step_s=0.5,
        lr=1e-4,
        figures={k: 1.0 for k in TRAIN_METRICS if k != "lr"},
    )
    reporter = ProgressReporter(metrics, Ledger(), {"g0": Pool()}, TrainingStats(step=1, last=step), Services())
    reporter.on_step(1, [step])
    reporter.report()
    reporter.publish_evaluation({"tau": 1.5, "macro_tau": 1.4, "per_category": {"chat": {"tau": 1.5}}})
    autoscaler = Autoscaler(AutoscalerConfig(), "r", 1.0, metrics_backend=FakeBackend)
    autoscaler.decide([GroupState("g0", replicas=1, ranks=1)], free_units=0.0, now=0.0)
    autoscaler.applied("g0", "add_replica", now=0.0)
    names = {}
    for m in (metrics, autoscaler.metrics):
        for full, (_, _, kind) in m._metrics.items():
            names[f"ray_{full}_total" if kind == "counter" else f"ray_{full}"] = kind
    return names


def panels() -> list[dict]:
    return json.loads(DASHBOARD.read_text())["panels"]


def test_every_panel_queries_series_the_job_exports():
    have = exported()
    assert len(have) > 20  # the recording reached every publisher
    for panel in panels():
        named = {s for t in panel["targets"] for s in SERIES.findall(t["expr"])}
        assert named, f"panel {panel['title']!r} queries no ray_dspark_ series"
        assert named <= have, f"panel {panel['title']!r} queries series nobody exports: {sorted(named - have)}"


def test_every_exported_series_has_a_panel():
    shown = {s for p in panels() for t in p["targets"] for s in SERIES.findall(t["expr"])}
    assert exported() <= shown, f"exported but on no panel: {sorted(exported() - shown)}"


def test_the_dashboard_imports_into_rays_grafana():
    # What Grafana's import needs, and what Ray's own dashboards do: a Prometheus data source
    # chosen at import (a variable), panels with unique ids on the grid, a uid of its own.
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] and dash["title"]
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == "${datasource}" and all(t["refId"] for t in p["targets"])
        assert 0 <= p["gridPos"]["x"] and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        assert all('run=~"$run"' in t["expr"] for t in p["targets"]), p["title"]


RATED = ("rate", "irate", "increase")
PRESENCE = ("present_over_time", "absent_over_time", "count_over_time", "absent")  # whether, not what


def misread_series(expr: str, kinds: dict[str, str]) -> list[str]:
    """What in `expr` reads a series against its kind: a counter's value outside rate()/irate()/
    increase() (its raw value is one driver's running total, from 0 again when a job is
    resubmitted), a gauge inside one (rate() of a gauge is meaningless: it takes every fall for a
    counter reset). Asking whether a series is there (present_over_time and the like) is neither."""
    wrong = []
    for name in sorted(set(SERIES.findall(expr))):
        uses = len(re.findall(rf"\b{name}\b", expr))
        rated = len(re.findall(rf"\b(?:{'|'.join(RATED)})\(\s*{name}\b", expr))
        present = len(re.findall(rf"\b(?:{'|'.join(PRESENCE)})\(\s*{name}\b", expr))
        kind = kinds.get(name)
        if kind == "counter" and rated + present < uses:
            wrong.append(f"counter {name} read outside {'/'.join(RATED)}()")
        elif kind == "gauge" and rated:
            wrong.append(f"gauge {name} read with {'/'.join(RATED)}()")
    return wrong


def test_counters_are_read_as_rates_and_gauges_as_gauges():
    kinds = exported_kinds()
    assert "counter" in kinds.values() and "gauge" in kinds.values()
    for panel in panels():
        for t in panel["targets"]:
            assert misread_series(t["expr"], kinds) == [], (panel["title"], t["expr"])
    # the check itself, on what it must catch
    assert misread_series('rate(ray_dspark_train_loss{run=~"$run"}[1m])', kinds)
    assert misread_series('ray_dspark_train_steps_total{run=~"$run"}', kinds)
    assert misread_series("increase(ray_dspark_train_steps_total[5m]) / ray_dspark_train_steps_total", kinds)


# -- against a real Prometheus (tests/integration/test_job.py) ----------------------------------
LEGEND_LABELS = re.compile(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")


def substitute(expr: str, run: str, rate_interval: str = "1m") -> str:
    """A panel's query as Grafana sends it for one run: `$run` (a regex match: the name escaped)
    and Grafana's interval variables."""
    out = expr.replace("$__rate_interval", rate_interval).replace("$__interval", "15s").replace("$__range", "1h")
    out = out.replace("$run", re.escape(run).replace("\\", "\\\\"))
    assert "$" not in out, f"a Grafana variable left in {out!r}"
    return out


def last_value(series: dict) -> float | None:
    values = [float(v) for _, v in series.get("values", []) if v not in ("NaN", "+Inf", "-Inf")]
    return values[-1] if values else None


def evaluate_panels(prom, run: str, start: float, end: float, step_s: float = 5.0) -> tuple[list[tuple], list[str]]:
    """Every panel's queries over [start, end] through Prometheus' HTTP API (`query_range`, as
    Grafana reads a time series panel). Returns the table (panel, legend, query, series, last value
    of the first series, names the job set) and the failures: a query that returns nothing though
    the job set a series it names, a legend naming a label the result lacks, the `$run` variable's
    own query not listing the run."""
    # the steps end on `end` (Prometheus steps from `start`): a series set last, as the job
    # ended (the held-out τ), is in the last step whatever the job's length
    start = end - math.ceil((end - start) / step_s) * step_s
    # what this run set, whatever its kind: every ray_dspark_ series name with its tag
    have = set(prom.label_values("__name__", f'{{__name__=~"ray_dspark_.+",run="{run}"}}', start, end))
    rows, failures = [], []
    run_var = next(v for v in json.loads(DASHBOARD.read_text())["templating"]["list"] if v["name"] == "run")
    match = re.fullmatch(r"label_values\((\w+), (\w+)\)", run_var["definition"])
    assert match, run_var["definition"]
    runs = prom.label_values(match[2], match[1], start, end)
    rows.append(("$run variable", "", run_var["definition"], len(runs), ",".join(runs), match[1] in have))
    if run not in runs:
        failures.append(f"the run variable's query {run_var['definition']} does not list {run!r}: {runs}")
    for panel in panels():
        for t in panel["targets"]:
            expr = substitute(t["expr"], run)
            named = set(SERIES.findall(t["expr"]))
            result = prom.query_range(expr, start, end, step_s)
            first = last_value(result[0]) if result else None
            rows.append((panel["title"], t.get("legendFormat", ""), expr, len(result), first, bool(named & have)))
            where = f"panel {panel['title']!r} ({t['refId']}: {expr})"
            if named & have and not result:
                failures.append(f"{where} returns nothing; the job set {sorted(named & have)}")
            for label in LEGEND_LABELS.findall(t.get("legendFormat", "")):
                if any(label not in s["metric"] for s in result):
                    failures.append(f"{where}: its legend names {{{{{label}}}}}, which its result lacks")
    return rows, failures


def format_table(rows: list[tuple]) -> str:
    def cell(v):
        return "-" if v is None else (f"{v:.6g}" if isinstance(v, float) else str(v))

    head = ("panel", "legend", "query", "series", "last value", "job sets it")
    lines = [" | ".join(head)] + [" | ".join(cell(v) for v in r) for r in rows]
    return "\n".join(lines)
