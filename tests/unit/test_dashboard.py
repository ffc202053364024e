"""The Grafana dashboard (deploy/grafana/dspark_dashboard.json) against what the code exports:
every panel's query names only series the job really sets, and every series the job sets is on
some panel. The exported set is recorded, not listed: the progress reporter, the evaluation's
gauges and the autoscaler run against a recording metrics backend, and Ray's naming is applied
(`ray_` in front; a counter is read as `<name>_total`)."""

from __future__ import annotations

import json
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
    names = set()
    for m in (metrics, autoscaler.metrics):
        for full, (_, _, kind) in m._metrics.items():
            names.add(f"ray_{full}_total" if kind == "counter" else f"ray_{full}")
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
